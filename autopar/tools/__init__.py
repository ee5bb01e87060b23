"""Tools on top of the pipeline: the command line, calibration, the cost-model benchmark and
the comparison report. They may import anything in ``autopar``; nothing imports them except
each other.
"""
