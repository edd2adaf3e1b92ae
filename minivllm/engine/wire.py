"""The tensor-parallel step message: a :class:`~minivllm.metadata.StepInput` as int64 tensors.

Rank 0 sends every step to ranks ``1 .. tp-1`` with two ``dist.broadcast``
calls and no pickling: a fixed :data:`HEADER_LEN`-element header that says
what follows, then ONE ``int64`` payload. Between steps the workers wait on
the header, so the header also carries the other commands (allocate the KV
cache, report its size, shut down).

What a step sends is the batch (token ids, positions, lengths, the rows to
sample) and the *changes* to the block tables, never the tables themselves:
each rank keeps its own table and applies them
(:meth:`~minivllm.engine.worker.Worker.update_block_tables`). Request ids are
strings; they travel as their UTF-8 bytes, one byte per int64.

Payload of ``CMD_EXECUTE``, end to end (``S`` scheduled requests, ``R``
removed ones, ``C`` block copies)::

    input_ids (T) | positions (T) | logits_indices (L)
    | C | copies (2C: src, dst, ...) | has_lora | lora ids (S, only if has_lora)
    | query_lens (S) | seq_lens (S) | is_new (S) | num_new_blocks (S)
    | new block ids (B, request by request)
    | id byte lengths (S + R) | id bytes (scheduled ids, then removed ids)
"""

from __future__ import annotations

from typing import Any

import torch

from minivllm.metadata import StepInput

HEADER_LEN = 8
CMD_EXECUTE, CMD_INIT_KV_CACHE, CMD_BYTES_PER_BLOCK, CMD_SHUTDOWN = 1, 2, 3, 4
CMD_MEMORY, CMD_TIMELINE = 5, 6  # report bytes held / per-micro-batch stage timings
CMD_ADD_LORA, CMD_REMOVE_LORA = 7, 8  # load an adapter (its name and path follow) / drop one


def make_header(*values: int) -> torch.Tensor:
    """A ``(HEADER_LEN,)`` int64 header: ``values`` then zeros."""
    if len(values) > HEADER_LEN:
        raise ValueError(f"a header holds at most {HEADER_LEN} values, got {len(values)}")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[: len(values)] = torch.tensor(values, dtype=torch.int64)
    return header


def pack_step_input(step: StepInput) -> tuple[torch.Tensor, torch.Tensor]:
    """``(header (8,), payload (n,))``, both int64 on the CPU.

    header = ``[CMD_EXECUTE, T, L, S, R, B, id_bytes, n]`` (see the module
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
    payload = torch.cat([step.input_ids, step.positions, step.logits_indices,
                         torch.tensor(host, dtype=torch.int64)])
    num_blocks = sum(len(b) for b in step.new_block_ids)
    header = make_header(CMD_EXECUTE, step.input_ids.numel(), step.logits_indices.numel(),
                         len(step.req_ids), len(step.removed_req_ids), num_blocks,
                         len(id_bytes), payload.numel())
    return header, payload


def unpack_step_input(header: torch.Tensor, payload: torch.Tensor) -> StepInput:
    """Invert :func:`pack_step_input` (the tensors stay on the CPU)."""
    _, T, L, S, R, B, nbytes, _ = header.tolist()
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
    )


def pack_lora_request(lora_request: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(header, payload)`` of ``CMD_ADD_LORA``: the id in the header, then the name and
    the path as UTF-8 bytes (one byte per int64), name first (header: their lengths)."""
    name, path = lora_request.lora_name.encode(), lora_request.lora_path.encode()
    payload = torch.tensor([*name, *path], dtype=torch.int64)
    # The payload's length goes last, where every receiver reads it (as CMD_EXECUTE's).
    return make_header(CMD_ADD_LORA, lora_request.lora_int_id, len(name), len(path),
                       0, 0, 0, payload.numel()), payload


def unpack_lora_request(header: torch.Tensor, payload: torch.Tensor) -> Any:
    """Invert :func:`pack_lora_request`."""
    from minivllm.lora.request import LoRARequest

    _, lora_int_id, num_name, _ = header.tolist()[:4]
    data = bytes(payload.tolist())
    return LoRARequest(data[:num_name].decode(), lora_int_id, data[num_name:].decode())
