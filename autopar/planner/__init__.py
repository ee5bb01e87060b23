"""Planner: a captured graph -> solved configurations (layouts, ZeRO, recomputation).

Owns the strategy space and its pricing (:mod:`.space`, :mod:`.pricing`, :mod:`.problem`: the
bridge to ``solver/``), repeated-layer tying (:mod:`.tying`), which activations backward keeps
(:mod:`.saved_activations`), checkpoint candidates (:mod:`.checkpointing`), the recipes
(:mod:`.recipes`), the ZeRO configurations weighed (:mod:`.zero_choice`) and the driver
(:mod:`.driver`), the one place that calls the solver.

Imports: base modules, ``capture``, ``strategies``, ``solver``, ``cost_models``.
"""
