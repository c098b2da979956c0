"""Op names as a config spells them (`aten.mm`, `aten.max.dim`, `higher_order.flex_attention`) and
the torch operators they name, for `checkpointing.save_ops` (trainer/model/checkpointing.py).

A leaf module (torch and trainer/private_apis/ only: torch exports the operator types from
`torch._ops`), so trainer/config/checkpointing.py can check the names before any rank starts.
"""

from __future__ import annotations

import torch

from trainer.private_apis.of_torch import HigherOrderOperator, OpOverload, OpOverloadPacket


def resolve_op(name: str) -> OpOverload | HigherOrderOperator:
    """The operator `namespace.op[.overload]` names (an OpOverloadPacket means its `default`
    overload, the one torch's dispatcher reports); raises ValueError saying why it names none."""
    namespace, _, rest = name.partition(".")
    op_name, _, overload = rest.partition(".")
    if not namespace or not op_name:
        raise ValueError("is not namespace.op[.overload], e.g. aten.mm")
    try:
        op = getattr(getattr(torch.ops, namespace), op_name)
    except (AttributeError, RuntimeError):
        raise ValueError(f"is not a torch op (torch.ops.{namespace} has no {op_name})") from None
    if isinstance(op, HigherOrderOperator):
        if overload:
            raise ValueError(f"names an overload of {namespace}.{op_name}, which has none")
        return op
    if not isinstance(op, OpOverloadPacket):
        raise ValueError("is not a torch op")
    overload = overload or "default"
    if overload not in op.overloads():
        raise ValueError(
            f"is not a torch op: {namespace}.{op_name} has overloads {', '.join(op.overloads())}"
        )
    return getattr(op, overload)


def unknown_op(name: str) -> str | None:
    """None when `name` names a torch operator, else why it does not."""
    try:
        resolve_op(name)
    except ValueError as err:
        return str(err)
    return None
