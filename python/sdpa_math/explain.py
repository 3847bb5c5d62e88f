"""sdpa_math.explain: the kernel a call would run, for the forward, its backward and (asked for) the
statistics of P, and why each path asked before it declined.

It asks the operator's own plan (src/cuda/route.h on CUDA; on the CPU, "cpu" or "reference"),
with every output, saved tensor and gradient as sdpa_math.attention and its autograd allocate
them, and runs nothing. `python -m sdpa_math explain --help` does the same from a shape."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Route:
    """The kernel that runs an op, and (path, reason) for each path asked before it, in order."""
    kernel: str
    declined: tuple[tuple[str, str], ...] = ()

    def why_not(self, path: str) -> str | None:
        """The reason `path` declined, or None when it was not asked or runs the op."""
        return next((why for p, why in self.declined if p == path), None)

    def __str__(self) -> str:
        lines = [self.kernel]
        lines += [f"  not {path}: {why}" for path, why in self.declined]
        return "\n".join(lines)


@dataclass(frozen=True)
class Explanation:
    forward: Route
    backward: Route | None = None
    stats: Route | None = None

    def __str__(self) -> str:
        parts = [("forward", self.forward), ("backward", self.backward), ("statistics", self.stats)]
        return "\n".join(f"{name}: {route}" for name, route in parts if route is not None)


def explain(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
            dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None, enable_gqa: bool = False,
            dropout_mask: torch.Tensor | None = None, backward: bool = True, grad_probs: bool = True,
            col_sum: bool = False, row_entropy: bool = False, rows: int = 0) -> Explanation:
    """The routes of sdpa_math.attention(query, key, value, attn_mask, dropout_p, is_causal, ...).

    backward: also the backward's route, with the gradients of q, k and v asked for (and of a
        float mask that requires grad); grad_probs: the loss reads P too (else only O's gradient
        flows back, as when P is unused).
    col_sum, row_entropy, rows: also the route of the statistics operator
        (torch.ops.sdpa_math.forward_stats) for these statistics (rows: that many rows of P);
        "none" means it has no kernel for them, and sdpa_math.stats.attention_stats computes
        them from chunks of P instead.

    Raises the operator's own error for inputs it refuses."""
    wants_stats = col_sum or row_entropy or rows > 0
    mask_grad = attn_mask is not None and attn_mask.is_floating_point() and attn_mask.requires_grad
    lines = torch.ops.sdpa_math.explain(query, key, value, attn_mask, float(dropout_p), bool(is_causal), dropout_mask,
                                        scale, bool(enable_gqa), bool(backward), bool(backward and grad_probs),
                                        [True, True, True, bool(backward and mask_grad)], bool(col_sum),
                                        bool(row_entropy), int(rows) if wants_stats else 0)
    routes: dict[str, list[tuple[str, str]]] = {}
    for line in lines:
        op, path, why = line.split("\t", 2)
        routes.setdefault(op, []).append((path, why))

    def route(op: str) -> Route | None:
        if op not in routes:
            return None
        *declined, (kernel, _) = routes[op]
        return Route(kernel, tuple(declined))

    return Explanation(route("forward"), route("backward"), route("stats"))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sdpa_math explain",
                                description="Which kernels sdpa_math runs for a problem, and why the others decline.")
    p.add_argument("--shape", required=True, help="B,H,L,S,E (batch, query heads, query rows, keys, head size)")
    p.add_argument("--kv-heads", type=int, help="key/value heads (GQA); default H")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32", "float64"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--mask", default="none", choices=["none", "bool", "float", "float32"],
                   help="a (B, 1, L, S) mask: bool, of the inputs' dtype (float) or float32")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--no-backward", action="store_true")
    p.add_argument("--stats", default="", help="comma-separated: col_sum, row_entropy, rows (the first min(64, L) rows of P)")
    return p


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    try:
        B, H, L, S, E = (int(x) for x in a.shape.split(","))
    except ValueError:
        raise SystemExit(f"--shape must be five integers B,H,L,S,E, got {a.shape!r}") from None
    dtype, dev = getattr(torch, a.dtype), torch.device(a.device)
    Hkv = a.kv_heads or H
    # The inputs themselves are allocated (the routes depend on their layout and alignment); the
    # outputs are not.
    q = torch.empty(B, H, L, E, dtype=dtype, device=dev)
    k, v = (torch.empty(B, Hkv, S, E, dtype=dtype, device=dev) for _ in range(2))
    mask = None
    if a.mask != "none":
        mask = torch.zeros(B, 1, L, S, dtype={"bool": torch.bool, "float": dtype, "float32": torch.float32}[a.mask],
                           device=dev)
    stats = {s.strip() for s in a.stats.split(",") if s.strip()}
    unknown = stats - {"col_sum", "row_entropy", "rows"}
    if unknown:
        raise SystemExit(f"--stats takes col_sum, row_entropy and rows, got {sorted(unknown)}")
    print(explain(q, k, v, mask, a.dropout, a.causal, enable_gqa=Hkv != H, backward=not a.no_backward,
                  col_sum="col_sum" in stats, row_entropy="row_entropy" in stats, rows=min(64, L) if "rows" in stats else 0))
    return 0

