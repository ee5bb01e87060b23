"""Capture: a model and example inputs -> a static ATen graph the planner can price.

Owns ``torch.export`` of the model (:mod:`.export`: FQNs, module paths, the canonical graph
hash), the value-preserving graph rewrites that open up sharding (:mod:`.exact_means`: exact
means), and the work of every node (:mod:`.flops`: FLOPs and bytes, forward and backward).

Imports: the base modules and ``autopar.strategies`` only (which ops have rules).
"""
