"""Notebook 09's tests: formulas and judgements called in the notebook's kernel, no ranks.

A check sends many calls in one request (`checks.call_each`) and compares each answer with a value the test computes
itself, accepting every kind of number the specs allow (int, float, Fraction; numpy scalars and Decimals arrive as
these)."""

from __future__ import annotations

import functools

from cs336_parallel import checks


def call_with(fn, args: tuple, kwargs: dict):
    """In the kernel: `fn(*args, **kwargs)` (`checks.call_each` sends positional cases only)."""
    return fn(*args, **kwargs)


def _shown(value) -> str:
    if isinstance(value, functools.partial):  # a memory model: its name and what it was given
        given = (f"{a:.4g}" if isinstance(a, float) else _shown(a) for a in value.args)
        return f"<{value.func.__name__}({', '.join(given)})>"
    if isinstance(value, dict) and "params" in value:
        return f"<{value['params']:.3g} parameters>"
    if isinstance(value, dict) and "flops" in value:
        return "<hardware>"
    return repr(value)


def shown_call(fn, args: tuple, kwargs: dict) -> str:
    """`name(1, 2, k=3)`, with the notebook's model and hardware dicts abbreviated."""
    return f"{fn.__name__}({', '.join([*map(_shown, args), *(f'{k}={_shown(v)}' for k, v in kwargs.items())])})"


def check_calls(fn, calls: list[tuple[tuple, dict, float]], *, rel_tol: float = 1e-9, abs_tol: float = 0.0) -> None:
    """`fn(*args, **kwargs)` for every (args, kwargs, expected) of `calls`, in one request: each must return a number
    (of any kind) within rel_tol (or abs_tol) of `expected`."""
    results = checks.call_each(call_with, [(fn, args, kwargs) for args, kwargs, _ in calls])
    for (args, kwargs, expected), got in zip(calls, results, strict=True):
        checks.assert_number(got, expected, name=shown_call(fn, args, kwargs), rel=rel_tol, abs_=abs_tol)


def check_refusals(fn, calls: list[tuple[tuple, dict]]) -> None:
    """Each (args, kwargs) of `calls` must raise ValueError: one request for all of them."""
    checks.assert_each_raises(ValueError, call_with, [(fn, args, kwargs) for args, kwargs in calls])


def check_crossover(crossover_batch, batches: list, compute_s: list, comm_s: list, expected: float,
                    case: str) -> None:
    """crossover_batch on these timings must return `expected`, a number within 1e-6 (relative) or 1e-9."""
    got = crossover_batch(batches, compute_s, comm_s)
    checks.assert_number(got, expected, name=f"{case}: crossover_batch", rel=1e-6, abs_=1e-9)


def layout_args(gpus: int, sequences: int, tp_ceiling: float, memory_bytes) -> dict:
    """choose_layout's keyword arguments."""
    return {"gpus": gpus, "sequences": sequences, "tp_ceiling": tp_ceiling, "memory_bytes": memory_bytes}


def check_layouts(choose_layout, cases: list[tuple[dict, dict, dict, tuple | None]]) -> None:
    """choose_layout(model, hardware, **kwargs) for every (model, hardware, kwargs, expected) of `cases`, in one
    request: the layout `expected`, (tp, pp) as two whole numbers, or None."""
    results = checks.call_each(call_with, [(choose_layout, (model, hw), kw) for model, hw, kw, _ in cases])
    for (model, hw, kw, expected), got in zip(cases, results, strict=True):
        call = shown_call(choose_layout, (model, hw), kw)
        checks.count_comparison()
        if expected is None:
            if got is not None:
                raise AssertionError(f"{call} returned {got!r}, expected None: no layout qualifies")
            continue
        pair = isinstance(got, (tuple, list)) and len(got) == 2 and all(checks.is_number(x) for x in got)
        if not pair or tuple(got) != expected:
            raise AssertionError(f"{call} returned {got!r}, expected (tp, pp) = {expected}")


# The tests' own copies of the notebook's figures: H100 SXM (datasheet; a 400 Gb/s port per GPU, Llama 3 paper,
# §3.3.1) and Llama 3 (paper, table 3; SwiGLU, three matrices of hidden x ffn).
GPU = {"flops": 989e12, "hbm": 3.35e12, "nvlink": 450e9, "nic": 50e9, "memory": 80e9, "gpus_per_node": 8}
REPORTED_MEMORY = 81_559 * 2**20  # bytes nvidia-smi reports for an H100 80GB HBM3 (NVIDIA/nccl issue #1264)
MODELS = {"8B": {"params": 8e9, "layers": 32, "hidden": 4096, "ffn": 14336, "matrices": 3},
          "70B": {"params": 70e9, "layers": 80, "hidden": 8192, "ffn": 28672, "matrices": 3},
          "405B": {"params": 405e9, "layers": 126, "hidden": 16384, "ffn": 53248, "matrices": 3}}
SEQ_LEN = 8192  # Llama 3 405B's pre-training sequences (Llama 3 paper, table 4)
# What one layer keeps for its backward per sequence of 8,192 tokens, without tensor parallelism: Korthikanti et
# al. 2022's 34 s h bytes in 16 bits, with an attention that keeps no s x s scores.
ACTIVATION_BYTES = {name: 34 * SEQ_LEN * model["hidden"] for name, model in MODELS.items()}


# -- memory models that choose_layout's tests hand it as memory_bytes(tp, pp) -------------------------------------

def sharded_memory(weights: float, state: float, activations: float, gpus: int, tp: int, pp: int) -> float:
    """Bytes on a GPU: `weights` split over a replica's tp x pp GPUs, `state` over all `gpus`, `activations` over
    tp (whatever pp, as 1F1B's first stage holds pp micro-batches of layers / pp layers)."""
    return weights / (tp * pp) + state / gpus + activations / tp


def zero2_memory(model: dict, gpus: int, activation_bytes: float) -> functools.partial:
    """memory_bytes(tp, pp) for `model` under ZeRO-2 over all `gpus`: bf16 weights (2 bytes a parameter) whole on a
    replica, bf16 gradients and the optimizer state (14) sharded; `activation_bytes` a layer without tensor
    parallelism, all the layers' worth. A simpler model than notebook 09's."""
    return functools.partial(sharded_memory, 2 * model["params"], 14 * model["params"],
                             model["layers"] * activation_bytes, gpus)


def table_memory(table: dict, default: float, tp: int, pp: int) -> float:
    """Bytes on a GPU from a table {(tp, pp): bytes}; `default` for a layout it does not list."""
    return table.get((tp, pp), default)


def llama_memory(model: dict, gpus: int, sequences: int, tp: int, pp: int) -> float:
    """The tests' copy of notebook 09's model of Llama 3's memory, as it states it: bf16 weights whole on a replica,
    fp32 gradients whole until the step's reduce-scatter, 12 bytes of optimizer state over all GPUs; the
    interleaved first stage's warm-up (v = 4, fewer where a chunk would hold no layer) of one-sequence micro-batches,
    each layer keeping 34 s h / tp bytes (tensor and sequence parallelism, no s x s scores)."""
    layers, dp = model["layers"], gpus // (tp * pp)
    m, v = max(1, sequences // dp), max(1, min(4, layers // pp))
    chunks = min(pp, m) * v if v == 1 else min(2 * (pp - 1) + (v - 1) * pp + 1, m * v)
    activations = chunks * layers / (pp * v) * 34 * SEQ_LEN * model["hidden"] / tp
    return (2 + 4) * model["params"] / (tp * pp) + 12 * model["params"] / gpus + activations


def llama_memory_bytes(model: dict, gpus: int, sequences: int) -> functools.partial:
    """memory_bytes(tp, pp) of notebook 09's model for `model` on `gpus` GPUs and `sequences` sequences a step."""
    return functools.partial(llama_memory, model, gpus, sequences)
