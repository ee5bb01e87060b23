"""Communication primitives: process groups per mesh axis and autograd-aware collectives.

Both the lowered graph (which calls the collectives) and the runtime (gradient sync, ZeRO) use
them, so they sit below both. The collectives execute the steps :mod:`autopar.resharding`
decides, with the backward the gradient convention implies.

Imports: base modules only.
"""
