"""Sharding strategies per ATen op. Importing this package registers every rule."""

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
from autopar.strategies import attention, dropout, embedding, factory, views  # noqa: F401,E402
from autopar.strategies import losses, matmul, norms, pointwise, reductions  # noqa: F401,E402
