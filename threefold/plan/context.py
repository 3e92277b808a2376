"""Bytes that context parallelism puts on the cp axis, per layer and micro-batch (torch-free).

``B_kv`` is the key/value bytes of one rank's tokens: 2 · micro_batch · (seq_len / cp) ·
kv_heads · head_dim · bytes per element; ``B_q`` the same for the queries (heads instead of
kv_heads), and the attention output has ``B_q`` bytes too. Per layer and micro-batch, forward
and backward together (threefold/parallel/context_parallel.py sends exactly these, counted by
the CommLedger under "cp"):

    ring        (3·cp − 2) · B_kv   forward: cp−1 sends of the key/value block around the ring;
                                    backward: cp−1 sends of the key/value block again (it is not
                                    kept) and cp sends of its gradient, which travels with it and
                                    takes one more hop to get home
    allgather   3 · (cp − 1) · B_kv an all-gather forward, the same all-gather again in backward
                                    (the gathered sequence is not kept) and a reduce-scatter of
                                    the key/value gradients; each moves (cp−1)/cp of cp · B_kv
    ulysses     2 · (cp−1)/cp · (2·B_q + B_kv)
                                    four all-to-alls forward (q, k, v from sequence-split to
                                    head-split, the output back), their transposes in backward

Recomputation repeats a layer's forward, and with it some of these bytes
(``recompute_bytes_per_layer``): selective recomputation reruns the ring's or the all-gather's
forward, sends included, (cp−1)·B_kv, but only the local attention of Ulysses, between its
all-to-alls (0 bytes); full recomputation reruns the whole block: (cp−1)·B_kv, or all four
forward all-to-alls of Ulysses, (cp−1)/cp·(2·B_q + B_kv).
"""
from __future__ import annotations

METHODS = ("ring", "allgather", "ulysses")


def qkv_bytes(micro_batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, cp: int,
              bytes_per_element: int = 4) -> tuple[int, int]:
    """(B_q, B_kv): the query bytes and the key/value bytes of one rank's ``seq_len / cp`` tokens."""
    tokens = micro_batch * seq_len // cp
    return tokens * heads * head_dim * bytes_per_element, 2 * tokens * kv_heads * head_dim * bytes_per_element


def ring_bytes_per_layer(cp: int, b_kv: float) -> float:
    return (3 * cp - 2) * b_kv if cp > 1 else 0.0


def allgather_bytes_per_layer(cp: int, b_kv: float) -> float:
    return 3 * (cp - 1) * b_kv


def ulysses_bytes_per_layer(cp: int, b_q: float, b_kv: float) -> float:
    return 2 * (cp - 1) / cp * (2 * b_q + b_kv)


def recompute_bytes_per_layer(method: str, recompute: str, cp: int, b_q: float, b_kv: float) -> float:
    """The bytes recomputation adds per layer and micro-batch (see the module docstring)."""
    if recompute == "none" or (method == "ulysses" and recompute == "selective"):
        return 0.0
    if method == "ulysses":
        return (cp - 1) / cp * (2 * b_q + b_kv)
    return (cp - 1) * b_kv


def cp_bytes_per_layer(method: str, cp: int, b_q: float, b_kv: float) -> float:
    """Bytes one rank sends on the cp axis per layer and micro-batch, forward and backward."""
    if method == "ring":
        return ring_bytes_per_layer(cp, b_kv)
    if method == "allgather":
        return allgather_bytes_per_layer(cp, b_kv)
    if method == "ulysses":
        return ulysses_bytes_per_layer(cp, b_q, b_kv)
    raise ValueError(f"unknown context-parallel method {method!r}; the methods are {METHODS}")


def cp_bytes_per_step(method: str, cp: int, recompute: str, layers: int, microbatches: int, micro_batch: int,
                      seq_len: int, heads: int, kv_heads: int, head_dim: int, bytes_per_element: int = 4) -> float:
    """Bytes one rank sends on the cp axis in a step for its ``layers`` blocks: every layer's
    per micro-batch bytes, the forward's again where recomputation repeats it. ``heads`` and
    ``kv_heads`` are this rank's (divided by tp)."""
    if cp == 1:
        return 0.0
    b_q, b_kv = qkv_bytes(micro_batch, seq_len, heads, kv_heads, head_dim, cp, bytes_per_element)
    per_layer = cp_bytes_per_layer(method, cp, b_q, b_kv) + recompute_bytes_per_layer(method, recompute, cp, b_q, b_kv)
    return layers * microbatches * per_layer
