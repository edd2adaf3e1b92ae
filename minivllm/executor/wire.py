"""The one message rank 0 sends the other ranks: a call, ``(method, args, kwargs)``.

Every rank operation travels the same way (vLLM v1's ``collective_rpc``):
rank 0 names a :class:`~minivllm.worker.worker.Worker` method and its
arguments, every other rank's loop (:func:`~minivllm.worker.worker.serve`)
calls ``getattr(worker, method)(*args, **kwargs)``. A message is two
``dist.broadcast`` calls: a fixed :data:`HEADER_LEN`-element int64 header
(the payload's length, and whether rank 0 waits for replies), then ONE
``uint8`` payload, the pickled call (:func:`pack_rpc`).

Most arguments are small Python values; the one that travels every step, a
:class:`~minivllm.metadata.StepInput`, is pickled in its own compact form
(:func:`pack_step_input`): the batch (token ids, positions, lengths, the
rows to sample) and the *changes* to the block tables, never the tables
themselves: each rank keeps its own table and applies them
(:meth:`~minivllm.worker.worker.Worker.update_block_tables`). Request ids are
strings; they travel as their UTF-8 bytes, one byte per int64.

A step, end to end (``S`` scheduled requests, ``R`` removed ones, ``C``
block copies)::

    input_ids (T) | positions (T) | logits_indices (L)
    | C | copies (2C: src, dst, ...) | has_lora | lora ids (S, only if has_lora)
    | query_lens (S) | seq_lens (S) | is_new (S) | num_new_blocks (S)
    | new block ids (B, request by request)
    | id byte lengths (S + R) | id bytes (scheduled ids, then removed ids)
    | the pickled SamplingPlan, 8 bytes an int64 (none: 0 words) | its byte count
"""

from __future__ import annotations

import copyreg
import io
import pickle

import torch

from minivllm.metadata import StepInput

HEADER_LEN = 2  # [payload bytes, reply (0 or 1)]
STEP_TAG = 0x53544550  # "STEP": the first word of pack_step_input's header, checked on unpack


def pack_rpc(method: str, args: tuple = (), kwargs: dict | None = None,
             reply: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(header (HEADER_LEN,) int64, payload (n,) uint8)``: the call, pickled.

    ``reply``: whether every rank sends its result (or its error) back to rank 0.
    """
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = copyreg.dispatch_table.copy()
    pickler.dispatch_table[StepInput] = _reduce_step_input
    pickler.dump((method, tuple(args), dict(kwargs or {})))
    payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    header = torch.tensor([payload.numel(), int(reply)], dtype=torch.int64)
    return header, payload


def unpack_rpc(payload: torch.Tensor) -> tuple[str, tuple, dict]:
    """Invert :func:`pack_rpc`: ``(method, args, kwargs)``."""
    return pickle.loads(payload.numpy().tobytes())


def _reduce_step_input(step: StepInput) -> tuple:
    """Pickle a step as its compact int64 message (not as a dataclass of tensors)."""
    header, payload = pack_step_input(step)
    return _step_from_bytes, (header.tolist(), payload.numpy().tobytes())


def _step_from_bytes(header: list[int], data: bytes) -> StepInput:
    payload = torch.frombuffer(bytearray(data), dtype=torch.int64)
    return unpack_step_input(torch.tensor(header, dtype=torch.int64), payload)


def pack_step_input(step: StepInput) -> tuple[torch.Tensor, torch.Tensor]:
    """``(header (8,), payload (n,))``, both int64 on the CPU.

    header = ``[STEP_TAG, T, L, S, R, B, id_bytes, n]`` (see the module
    docstring for the payload).
    """
    ids = [*step.req_ids, *step.removed_req_ids]
    encoded = [i.encode() for i in ids]
    id_bytes = b"".join(encoded)
    host = [
        len(step.blocks_to_copy), *(b for pair in step.blocks_to_copy for b in pair),
        int(bool(step.lora_ids)), *step.lora_ids,
        *step.query_lens, *step.seq_lens,
        *(int(i in step.new_req_ids) for i in step.req_ids),
        *(len(b) for b in step.new_block_ids),
        *(block for blocks in step.new_block_ids for block in blocks),
        *(len(e) for e in encoded),
        *id_bytes,  # iterating over bytes gives ints in [0, 256)
    ]
    plan = b"" if step.sampling is None else pickle.dumps(step.sampling)
    words = torch.frombuffer(bytearray(plan + bytes(-len(plan) % 8)) or bytearray(8),
                             dtype=torch.int64)[: (len(plan) + 7) // 8]
    payload = torch.cat([step.input_ids, step.positions, step.logits_indices,
                         torch.tensor(host, dtype=torch.int64), words,
                         torch.tensor([len(plan)], dtype=torch.int64)])
    num_blocks = sum(len(b) for b in step.new_block_ids)
    header = torch.tensor([STEP_TAG, step.input_ids.numel(), step.logits_indices.numel(),
                           len(step.req_ids), len(step.removed_req_ids), num_blocks,
                           len(id_bytes), payload.numel()], dtype=torch.int64)
    return header, payload


def unpack_step_input(header: torch.Tensor, payload: torch.Tensor) -> StepInput:
    """Invert :func:`pack_step_input` (the tensors stay on the CPU)."""
    tag, T, L, S, R, B, nbytes, _ = header.tolist()
    if tag != STEP_TAG:
        raise ValueError(f"not a step message: header starts with {tag:#x}, not {STEP_TAG:#x}")
    plan_bytes = int(payload[-1])
    num_words = (plan_bytes + 7) // 8
    plan = None if not plan_bytes else pickle.loads(
        payload[-1 - num_words : -1].numpy().tobytes()[:plan_bytes])
    payload = payload[: -1 - num_words]
    input_ids, positions, logits_indices, host = payload.split([T, T, L, payload.numel() - 2 * T - L])
    host = host.tolist()  # the payload is on the CPU: these host copies are free
    num_copies = host[0]
    copies = tuple(zip(host[1 : 1 + 2 * num_copies : 2], host[2 : 2 + 2 * num_copies : 2]))
    host = host[1 + 2 * num_copies :]
    has_lora, host = host[0], host[1:]
    lora_ids = tuple(host[:S]) if has_lora else ()
    host = host[S:] if has_lora else host
    query_lens, seq_lens = host[:S], host[S : 2 * S]
    is_new, num_new_blocks = host[2 * S : 3 * S], host[3 * S : 4 * S]
    blocks = host[4 * S : 4 * S + B]
    lengths = host[4 * S + B : 5 * S + B + R]
    text = bytes(host[5 * S + B + R :])
    if len(text) != nbytes:
        raise ValueError(f"step message: {len(text)} id bytes, the header says {nbytes}")
    ids, start = [], 0
    for n in lengths:
        ids.append(text[start : start + n].decode())
        start += n
    req_ids, removed = ids[:S], ids[S:]
    new_block_ids, start = [], 0
    for n in num_new_blocks:
        new_block_ids.append(tuple(blocks[start : start + n]))
        start += n
    return StepInput(
        req_ids=tuple(req_ids),
        new_req_ids=frozenset(i for i, new in zip(req_ids, is_new) if new),
        new_block_ids=tuple(new_block_ids),
        removed_req_ids=tuple(removed),
        query_lens=tuple(query_lens),
        seq_lens=tuple(seq_lens),
        input_ids=input_ids.clone(),
        positions=positions.clone(),
        logits_indices=logits_indices.clone(),
        blocks_to_copy=copies,
        lora_ids=lora_ids,
        sampling=plan,
    )
