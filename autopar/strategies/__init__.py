"""Sharding strategies per ATen op. Importing this package registers every rule."""

from autopar.strategies import (  # noqa: F401,E402  # noqa: F401,E402
    attention,
    dropout,
    embedding,
    factory,
    losses,
    matmul,
    norms,
    pointwise,
    reductions,
    views,
)
from autopar.strategies.registry import (  # noqa: F401
    AxisStrategy,
    OpCall,
    Strategy,
    TensorMeta,
    expand,
    get_rule,
    input_nodes,
    op_call,
    register,
    registered_ops,
    replicate_all,
    strategies_for,
)
