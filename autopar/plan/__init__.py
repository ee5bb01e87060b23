"""Plan: the solver's answer in user terms.

Owns the :class:`~autopar.plan.document.Plan` (its versioned JSON document, validated against
``schema.json``, summary and explain), the document's assembly from the driver's result
(:mod:`.build`) and the on-disk plan cache (:mod:`.cache`).

Imports: base modules, ``capture``, ``strategies``, ``planner``.
"""
