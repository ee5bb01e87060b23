"""Plan: the solver's answer in user terms.

Owns the :class:`~autopar.plan.document.Plan` (its versioned JSON document, validated against
``schema.json``), the document's assembly from the driver's result (:mod:`.build`, with the
alternatives ``explain`` shows from :mod:`.alternatives`), the summary as plain data
(:mod:`.summary`) and as terminal text (:mod:`.render`), explain from the JSON
(:mod:`.explain`) and the on-disk plan cache (:mod:`.cache`).

Imports: base modules, ``capture``, ``strategies``, ``planner``.
"""
