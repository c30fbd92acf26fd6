"""2. The loaded program: torch operators only, and no state kept between calls.

Every call is an aten OpOverload, an allowed higher-order operator or `getitem`; functionalised
where that could show something, the program must mutate nothing and draw no random numbers.
After scoring, every tensor of the module must be bit-for-bit what it was (`snapshot`,
`check_unchanged`): a program whose output can depend on how often it was called is refused.
"""

from __future__ import annotations

import json
import operator
from typing import Any

from evaluate_common import (ALLOWED_HIGHER_ORDER_OPS, DENIED_ATEN_OPS, Failure, HARNESS_ERROR, PAYLOADS,
                             PLAIN_COMPOSITES, refuse)
from evaluate_archive import rebuild_archive
from evaluate_causality import _same_bits


def load_program(members: dict[str, bytes], candidate_had_gpu: bool = True):
    """candidate_had_gpu False: the candidate trained with no GPU (run.py knows), so an archive
    that names a CUDA device is its own forgery, not a fault of this machine's."""
    import torch

    devices = set()
    for config_name, _ in PAYLOADS.values():
        for entry in json.loads(members[config_name])["config"].values():
            devices.add(str((entry["tensor_meta"].get("device") or {}).get("type")))
    if "cuda" in devices and not candidate_had_gpu:
        raise refuse("its tensors claim a CUDA device, but the candidate ran without a GPU")
    if "cuda" in devices and not torch.cuda.is_available():
        raise Failure("harness", "the model was exported on a GPU but the evaluator has none", HARNESS_ERROR)
    try:
        return torch.export.load(rebuild_archive(members))
    except Exception as e:
        raise refuse(f"torch.export.load failed: {type(e).__name__}: {e}") from e


def check_program(program, batch_size: int, seq_len: int) -> None:
    """Refuse calls of anything but torch operators, and programs that keep state between calls."""
    import torch
    from torch.export.graph_signature import InputKind

    user_inputs = [s for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    if len(user_inputs) != 1:
        raise refuse(f"the program takes {len(user_inputs)} inputs; it must take the token ids alone")
    idx = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == user_inputs[0].arg.name)
    val = idx.meta.get("val")
    if getattr(val, "dtype", None) != torch.int64 or tuple(getattr(val, "shape", ())) != (batch_size, seq_len):
        raise refuse(f"the program takes {getattr(val, 'dtype', None)} of shape {tuple(getattr(val, 'shape', ()))}; "
                     f"export_model exports token ids, int64 of shape ({batch_size}, {seq_len})")
    _check_calls(program.graph_module)
    if _plainly_functional(program.graph_module):
        # Re-tracing would find no write and no hidden operator (1.8 s of a tiny run's CPU saved).
        checked = program
    else:
        try:
            checked = program.run_decompositions({})
        except Exception as e:
            raise refuse(f"the program cannot be functionalised: {type(e).__name__}: {e}") from e
    signature = checked.graph_signature
    mutated = {**signature.buffers_to_mutate, **signature.user_inputs_to_mutate,
               **getattr(signature, "parameters_to_mutate", {})}
    if mutated or len(signature.output_specs) != 1:
        names = sorted(set(mutated.values())) or [str(s.kind) for s in signature.output_specs]
        raise refuse(f"the program changes its own state when called ({', '.join(names)}); it must be a pure "
                     "function of the token ids")
    for gm in checked.graph_module.modules():
        for node in getattr(getattr(gm, "graph", None), "nodes", []):
            target = node.target
            if isinstance(target, torch._ops.OpOverload):
                if target._schema.is_mutable:
                    raise refuse(f"the program mutates a tensor in place with {target} after functionalisation")
                if _draws_random_numbers(node):
                    raise refuse(f"the program draws random numbers ({target}); it must be deterministic")


def _plainly_functional(root) -> bool:
    """No operator in any graph of the program writes to a tensor (a mutable schema: in place,
    out=, set_, resize_), and each composite one is in PLAIN_COMPOSITES: functionalising it
    would give back the same operators, so check_program may check the program as it is."""
    import torch

    for gm in root.modules():
        for node in getattr(getattr(gm, "graph", None), "nodes", []):
            target = node.target
            if not isinstance(target, torch._ops.OpOverload):
                continue  # _check_calls let only getitem and the allowed regions through
            if target._schema.is_mutable:
                return False
            if str(target) not in PLAIN_COMPOSITES and torch._C._dispatch_has_kernel_for_dispatch_key(
                    target.name(), "CompositeImplicitAutograd"):
                return False
    return True


def _draws_random_numbers(node) -> bool:
    """A random-number operator, unless its dropout is off (attention with dropout_p=0, dropout(train=False))."""
    import torch

    schema = node.target._schema
    if torch.Tag.nondeterministic_seeded not in node.target.tags:
        return False
    args = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    args.update({a.name: v for a, v in zip(schema.arguments, node.args)})
    args.update(node.kwargs)
    if "dropout_p" in args:
        return args["dropout_p"] != 0
    if "train" in args or "training" in args:
        return bool(args.get("train", args.get("training")))
    return True


def _check_calls(root) -> None:
    import torch

    for gm in root.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            raise refuse(f"the program holds a module of type {type(gm).__name__}, not a graph")
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if node.op == "get_attr":
                value = _attr(gm, node.target)
                if not isinstance(value, (torch.Tensor, torch.fx.GraphModule)):
                    raise refuse(f"the graph reads an attribute {node.target!r} of type {type(value).__name__}")
                continue
            target = node.target
            if node.op == "call_function" and (
                (isinstance(target, torch._ops.OpOverload) and target.namespace == "aten"
                 and target._schema.name.split("::")[-1] not in DENIED_ATEN_OPS
                 and not any(a.name == "filename" for a in target._schema.arguments))
                or (isinstance(target, torch._ops.HigherOrderOperator) and target.name() in ALLOWED_HIGHER_ORDER_OPS)
                or target is operator.getitem
            ):
                continue
            raise refuse(f"the graph node {node.name} is {node.op} {target!r}; only aten operators, the "
                         "autocast/grad-mode regions and getitem are accepted")


def _attr(module, dotted: str) -> Any:
    for atom in str(dotted).split("."):
        module = getattr(module, atom, None)
    return module


def snapshot(model) -> dict[str, Any]:
    """Copies of every tensor the module holds: parameters, buffers and constants."""
    import torch

    state = {}
    for prefix, sub in model.named_modules(remove_duplicate=False):
        for name, value in list(vars(sub).items()) + list(sub._parameters.items()) + list(sub._buffers.items()):
            if isinstance(value, torch.Tensor):
                state[f"{prefix}.{name}" if prefix else name] = value.detach().clone()
    return state


def check_state(model) -> None:
    """Refuse tensors whose elements overlap in memory (an expanded, stride-0 view): their bytes in the
    archive are few, but snapshot's copy of them is dense (2**40 elements from 4 bytes), and a copy that
    cannot be made must not end the evaluation as the harness's error (a free re-run for the candidate).
    A view with gaps (a slice) is fine: its copy is smaller than what it holds."""
    import torch

    for prefix, sub in model.named_modules(remove_duplicate=False):
        for name, value in list(vars(sub).items()) + list(sub._parameters.items()) + list(sub._buffers.items()):
            if not isinstance(value, torch.Tensor) or value.numel() <= 1:
                continue
            what = f"its tensor {prefix + '.' if prefix else ''}{name} of shape {tuple(value.shape)}"
            if value.layout != torch.strided:
                raise refuse(f"{what} is {value.layout}; only strided (dense) tensors are accepted")
            dense, held = value.numel() * value.element_size(), value.untyped_storage().nbytes()
            if dense > held:
                raise refuse(f"{what} (strides {value.stride()}) has {dense} bytes of elements in {held} bytes "
                             "of memory: its elements overlap (an expanded view); give it memory of its own "
                             "(.clone()) before export")


def check_unchanged(model, before: dict[str, Any]) -> None:
    after = snapshot(model)
    changed = sorted(k for k in before.keys() | after.keys()
                     if k not in before or k not in after or not _same_bits(before[k], after[k]))
    if changed:
        raise refuse(f"the program changed its own tensors while it was evaluated ({', '.join(changed[:5])}); "
                     "its output may depend on how often it was called")
