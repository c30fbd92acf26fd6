"""4. What the model costs, read off the checked graph: FLOPs per token and depth, for the
harness's own MFU (`model_figures`).

FLOPs per token as train.py counts them (6 per parameter a token's matmuls use; embeddings are
lookups and cost none; plus 12 x seq_len x width per attention layer), the depth one layer per
scaled_dot_product_attention call. Parameters the graph never reads are not counted.
Informational: nothing here fails an evaluation.
"""

from __future__ import annotations

from typing import Any

from evaluate_program import _attr


MATMUL_FLOPS_PER_PARAM = 6  # per token: 2 forward, 4 backward (train.py's FLOPS_PER_TOKEN)
# Operators that hand a parameter on unchanged but for its view or dtype: a weight read through
# one of these is used where the result is used (a bf16 cast before a matmul, a transpose).
PASS_THROUGH_OPS = frozenset({"to", "_to_copy", "view", "_unsafe_view", "reshape", "t", "transpose",
                              "permute", "detach", "alias", "clone", "contiguous", "unsqueeze",
                              "squeeze", "expand"})


def model_figures(program) -> dict[str, Any]:
    """{"flops_per_token", "depth", "matmul_params"} of a checked program, counted as train.py
    counts FLOPS_PER_TOKEN: MATMUL_FLOPS_PER_PARAM per parameter that some operator other than
    an embedding lookup reads (a parameter the graph never reads is not counted), plus, per
    scaled_dot_product_attention call with query (.., Hq, T, Dqk), key (.., S, Dqk) and value
    (.., S, Dv), 6 x S x Hq x (Dqk + Dv): train.py's 12 x seq_len x width when Dqk = Dv. Depth
    is the number of attention calls (None if there are none: then the graph cannot say).

    Parameters are followed into the autocast and grad-mode regions (a region's placeholders
    are its operands, in order)."""
    import torch

    state = program.state_dict
    uses: dict[str, set[str]] = {}
    attention: list[int] = []

    def walk(gm, bound: dict) -> None:
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            target = node.target
            if isinstance(target, torch._ops.HigherOrderOperator):
                regions = [i for i, a in enumerate(node.args) if isinstance(a, torch.fx.Node)
                           and a.op == "get_attr" and isinstance(_attr(gm, a.target), torch.fx.GraphModule)]
                if regions:
                    sub = _attr(gm, node.args[regions[0]].target)
                    holders = [n for n in sub.graph.nodes if n.op == "placeholder"]
                    walk(sub, {h: bound.get(a) for h, a in zip(holders, node.args[regions[0] + 1:])
                               if isinstance(a, torch.fx.Node)})
                continue
            if not isinstance(target, torch._ops.OpOverload):
                continue
            name = target._schema.name.split("::")[-1]
            inputs = node.all_input_nodes
            if name in PASS_THROUGH_OPS and len(inputs) == 1 and bound.get(inputs[0]):
                bound[node] = bound[inputs[0]]
                continue
            for a in inputs:
                if bound.get(a):
                    lookup = name == "embedding" and node.args and node.args[0] is a
                    uses.setdefault(bound[a], set()).add("lookup" if lookup else "compute")
            if "scaled_dot_product" in name:
                q, k, v = (node.args[i].meta["val"].shape for i in range(3))
                attention.append(6 * int(k[-2]) * int(q[-3]) * (int(q[-1]) + int(v[-1])))

    params = program.graph_signature.inputs_to_parameters
    walk(program.graph_module, {n: params.get(n.name) for n in program.graph.nodes if n.op == "placeholder"})
    matmul = sum(state[p].numel() for p, kinds in uses.items() if "compute" in kinds and p in state)
    return {"flops_per_token": MATMUL_FLOPS_PER_PARAM * matmul + sum(attention),
            "depth": len(attention) or None, "matmul_params": matmul}


def _figures_or_none(program) -> dict[str, Any]:
    """model_figures, or Nones where the graph defeats it: these figures never fail a run."""
    try:
        return model_figures(program)
    except Exception as e:
        print(f"could not count the model's FLOPs ({type(e).__name__}: {e}); MFU is not measured", flush=True)
        return {"flops_per_token": None, "depth": None, "matmul_params": None}


def _device_name(device) -> str | None:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else None
