"""Bytes that context parallelism puts on the cp axis, per layer and micro-batch (torch-free).

``B_kv`` is the key/value bytes of one rank's tokens: 2 · micro_batch · (seq_len / cp) ·
kv_heads · head_dim · bytes per element; ``B_q`` the queries' bytes alone, micro_batch ·
(seq_len / cp) · heads · head_dim · bytes per element, and the attention output has ``B_q`` bytes too. Per layer and micro-batch, forward
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

Mixture-of-Experts blocks add, per MoE layer and micro-batch, the statistics that are over the
micro-batch's tokens (``SplitMicroBatch`` in context_parallel.py, counted under "cp.routing"), with
E experts, top-k and T = micro_batch · seq_len / cp tokens on each rank:

    balance loss on   2·(cp−1)/cp · E · 8      an all-reduce of the E int64 routed counts (its f)
    capacity c > 0    (cp−1) · T · k · 8       an all-gather of every share's chosen experts

and a forward recomputed in full (not a selective one, which reruns the attention core only)
sends both again (``moe_bytes_per_step``).
"""
from __future__ import annotations

import numpy as np

METHODS = ("ring", "allgather", "ulysses")


def _number(value):
    """A 0-d result as a Python float; arrays (the planner's search) stay arrays."""
    return float(value) if np.ndim(value) == 0 else value


def qkv_bytes(micro_batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, cp: int,
              bytes_per_element: int = 4) -> tuple[int, int]:
    """(B_q, B_kv): the query bytes and the key/value bytes of one rank's ``seq_len / cp`` tokens."""
    tokens = micro_batch * seq_len // cp
    return tokens * heads * head_dim * bytes_per_element, 2 * tokens * kv_heads * head_dim * bytes_per_element


def ring_bytes_per_layer(cp, b_kv):
    return _number(np.where(np.asarray(cp) > 1, (3 * np.asarray(cp) - 2) * b_kv, 0.0))


def allgather_bytes_per_layer(cp, b_kv):
    return _number(3 * (np.asarray(cp) - 1) * b_kv)


def ulysses_bytes_per_layer(cp, b_q, b_kv):
    return _number(2 * (np.asarray(cp) - 1) / cp * (2 * b_q + b_kv))


def messages_per_layer(method, cp, recompute="none"):
    """Messages (point-to-point sends, or ring steps of a collective) one rank sends per layer and
    micro-batch, forward and backward: what the link's latency is paid on. ring: 3·cp − 2 sends;
    allgather: three collectives of cp − 1 steps; ulysses: eight all-to-alls of cp − 1 steps.
    Recomputation repeats the forward's where ``recompute_bytes_per_layer`` repeats its bytes:
    cp − 1 (ring, allgather), 4·(cp − 1) (ulysses, full only)."""
    method, recompute, cp = _method_index(method), _recompute_index(recompute), np.asarray(cp)
    ulysses = method == METHODS.index("ulysses")
    again = np.where(ulysses, np.where(recompute == 2, 4 * (cp - 1), 0), np.where(_reruns_core(recompute), cp - 1, 0))
    return _number(np.where(cp > 1, np.choose(method, [3 * cp - 2, 3 * (cp - 1), 8 * (cp - 1)]) + again, 0))


def recompute_bytes_per_layer(method, recompute, cp, b_q, b_kv):
    """The bytes recomputation adds per layer and micro-batch (see the module docstring).
    ``method`` and ``recompute`` are names, or (the planner's arrays) indices into METHODS and
    ("none", "selective", "full")."""
    method, recompute = _method_index(method), _recompute_index(recompute)
    cp = np.asarray(cp)
    ulysses_full = np.where(recompute == 2, (cp - 1) / cp * (2 * b_q + b_kv), 0.0)
    forward_again = np.where(_reruns_core(recompute), (cp - 1) * b_kv, 0.0)
    return _number(np.where(method == METHODS.index("ulysses"), ulysses_full, forward_again))


def cp_bytes_per_layer(method, cp, b_q, b_kv):
    """Bytes one rank sends on the cp axis per layer and micro-batch, forward and backward.
    ``method`` is a name or (arrays) indices into METHODS."""
    index = _method_index(method)
    each = np.broadcast_arrays(ring_bytes_per_layer(cp, b_kv), allgather_bytes_per_layer(cp, b_kv),
                               ulysses_bytes_per_layer(cp, b_q, b_kv))
    return _number(np.choose(index, each))


def _method_index(method):
    if isinstance(method, str):
        if method not in METHODS:
            raise ValueError(f"unknown context-parallel method {method!r}; the methods are {METHODS}")
        return METHODS.index(method)
    return np.asarray(method)


def _recompute_index(recompute):
    return ("none", "selective", "full", "op").index(recompute) if isinstance(recompute, str) else np.asarray(recompute)


def _reruns_core(recompute):
    """Whether the recomputation (an index into the planner's RECOMPUTE: none, selective, full, op)
    reruns the attention core, its sends included: selective and full do; op-level selective
    checkpointing (index 3) saves the attention kernel's output, and a context-parallel attention
    runs inside that kernel's call (PyTorch's context_parallel dispatches the SDPA operator to its
    ring), so nothing of it is rerun."""
    return (recompute == 1) | (recompute == 2)


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


def moe_bytes_per_layer(cp, tokens, top_k, num_experts, aux_loss: bool, capacity: bool, count_bytes: int = 8):
    """Bytes one rank sends under "cp.routing" per MoE layer and micro-batch for the routing
    statistics (see the module docstring); ``tokens`` is this rank's T = micro_batch · seq_len / cp."""
    cp = np.asarray(cp)
    counts = np.where(aux_loss, 2 * (cp - 1) / cp * num_experts * count_bytes, 0.0)
    choices = np.where(capacity, (cp - 1) * tokens * top_k * count_bytes, 0.0)
    return _number(counts + choices)


def moe_bytes_per_step(cp: int, recompute: str, moe_layers: int, microbatches: int, tokens: int, top_k: int,
                       num_experts: int, aux_loss: bool, capacity: bool) -> float:
    """``moe_bytes_per_layer`` for a step's ``moe_layers`` MoE blocks and micro-batches, twice
    under full recomputation (its forward, collectives included, runs again)."""
    if cp == 1:
        return 0.0
    again = 2 if recompute == "full" else 1
    return again * moe_layers * microbatches * moe_bytes_per_layer(cp, tokens, top_k, num_experts, aux_loss, capacity)
