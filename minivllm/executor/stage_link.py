"""How one rank of a (tensor x pipeline)-parallel group talks to the ranks around it.

Ranks are laid out tensor-parallel inner, as in vLLM:
``rank = pp_rank * tp_size + tp_rank``. Every message of a step travels one
way, stage to stage, each ``tp_rank`` to the same ``tp_rank`` of the next
stage:

- stage 0's rank 0 (the engine process) broadcasts each call (a header and
  its payload, :mod:`minivllm.executor.wire`) to its own stage's
  tensor-parallel peers, as plain tensor parallelism does, and every rank of
  a stage *forwards* them to its counterpart in the next stage (``isend``);
- a stage that is not the first receives the previous stage's
  ``hidden_states`` and ``residual`` (:class:`~minivllm.pp_stages.IntermediateTensors`,
  each ``(T, hidden)``, full on every tensor-parallel rank), runs its layers
  and sends its own on;
- the last stage's ``tp_rank`` 0 samples, and sends the step's token ids back
  to rank 0 (a pickled :class:`~minivllm.step_sampling.ModelRunnerOutput`: its
  size, then its bytes), never rows of logits.

Each link is FIFO, and every rank handles the steps in the order rank 0
sent them, so a later micro-batch never overtakes an earlier one anywhere;
that is why one request's KV writes in batch ``n`` are always in place when
batch ``n + 1`` reads them, on every stage. Sends are ``isend``: a stage goes
on to its next micro-batch while its last output is still on the wire (one
outstanding send per link, waited for before the next).

Headers and payloads go on gloo groups (the world control group, long
timeout, for a worker's idle wait; the world CPU group for the rest), the
tensors on the world device group (gloo on a CPU, NCCL on CUDA).
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import torch
import torch.distributed as dist

from minivllm import distributed
from minivllm.executor import wire
from minivllm.pp_stages import IntermediateTensors, global_rank, rank_coords


class StageLink:
    """This rank's neighbours and its sends in flight.

    Args:
        rank: this process's rank.
        tp_size, pp_size: the group's shape.
        hidden_size: the model's hidden size (the shape of what stages exchange).
        dtype, device: of the intermediate tensors.
    """

    def __init__(self, rank: int, tp_size: int, pp_size: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.rank, self.tp_size, self.pp_size = rank, tp_size, pp_size
        self.pp_rank, self.tp_rank = rank_coords(rank, tp_size)
        self.prev = (global_rank(self.pp_rank - 1, self.tp_rank, tp_size)
                     if self.pp_rank > 0 else None)
        self.next = (global_rank(self.pp_rank + 1, self.tp_rank, tp_size)
                     if self.pp_rank < pp_size - 1 else None)
        self.last_rank0 = global_rank(pp_size - 1, 0, tp_size)  # sends the logits
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self._sends: list[tuple[object, tuple[torch.Tensor, ...]]] = []

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    # -- the call (header, payload) ----------------------------------------------

    def send_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                 reply: bool = True) -> None:
        """Rank 0: hand one call (:func:`~minivllm.executor.wire.pack_rpc`) to stage 0's
        peers and to the next stage."""
        header, payload = wire.pack_rpc(method, args, kwargs, reply)
        if self.tp_size > 1:
            dist.broadcast(header, src=0, group=distributed.get_control_group())
            dist.broadcast(payload, src=0, group=distributed.get_cpu_group())
        self.forward(header, distributed.get_world_control_group())
        self.forward(payload, distributed.get_world_cpu_group())

    def recv_rpc(self) -> tuple[str, tuple, dict, bool]:
        """A worker's idle wait: the next call, from rank 0 or the previous stage,
        forwarded on. ``(method, args, kwargs, reply)``."""
        header = torch.empty(wire.HEADER_LEN, dtype=torch.int64)
        if self.prev is None:
            dist.broadcast(header, src=0, group=distributed.get_control_group())
        else:
            dist.recv(header, src=self.prev, group=distributed.get_world_control_group())
        self.forward(header, distributed.get_world_control_group())
        numel, reply = header.tolist()
        payload = torch.empty(numel, dtype=torch.uint8)
        if self.prev is None:
            dist.broadcast(payload, src=0, group=distributed.get_cpu_group())
        else:
            dist.recv(payload, src=self.prev, group=distributed.get_world_cpu_group())
        self.forward(payload, distributed.get_world_cpu_group())
        return (*wire.unpack_rpc(payload), bool(reply))

    def forward(self, tensor: torch.Tensor, group: object) -> None:
        """Send ``tensor`` to the next stage's same tensor-parallel rank, if there is one."""
        if self.next is not None:
            self._isend((tensor,), self.next, group)

    # -- what stages exchange ----------------------------------------------------

    def recv_intermediate(self, num_tokens: int) -> IntermediateTensors:
        """The previous stage's ``hidden_states`` and ``residual``, each ``(T, hidden)``."""
        shape = (num_tokens, self.hidden_size)
        hidden = torch.empty(shape, dtype=self.dtype, device=self.device)
        residual = torch.empty(shape, dtype=self.dtype, device=self.device)
        dist.recv(hidden, src=self.prev)
        dist.recv(residual, src=self.prev)
        return IntermediateTensors(hidden_states=hidden, residual=residual)

    def send_intermediate(self, tensors: IntermediateTensors) -> None:
        """This stage's output, to the next stage."""
        self._isend((tensors.hidden_states.contiguous(), tensors.residual.contiguous()),
                    self.next, None)

    def send_output(self, output: Any) -> None:
        """The last stage's tp rank 0: the step's pickled
        :class:`~minivllm.step_sampling.ModelRunnerOutput` (its size, then its bytes)."""
        if self.tp_rank != 0:
            return
        try:
            blob = pickle.dumps(output)
        except Exception:  # noqa: BLE001 -- a failure's exception rank 0 could not rebuild
            failures = tuple((rid, RuntimeError(f"{type(e).__name__}: {e}"))
                             for rid, e in output.failures)
            blob = pickle.dumps(dataclasses.replace(output, failures=failures))
        data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        self._isend((size, data), 0, distributed.get_world_cpu_group())

    def recv_output(self) -> Any:
        """Rank 0: wait for one micro-batch's output from the last stage (in order)."""
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=self.last_rank0, group=distributed.get_world_cpu_group())
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(data, src=self.last_rank0, group=distributed.get_world_cpu_group())
        return pickle.loads(data.numpy().tobytes())

    # -- sends in flight -----------------------------------------------------------

    def _isend(self, tensors: tuple[torch.Tensor, ...], dst: int, group: object) -> None:
        self.wait_sends(keep=8)
        for t in tensors:
            self._sends.append((dist.isend(t, dst=dst, group=group), (t,)))

    def wait_sends(self, keep: int = 0) -> None:
        """Wait for all but the ``keep`` most recent sends (they hold their tensors alive)."""
        while len(self._sends) > keep:
            work, _ = self._sends.pop(0)
            work.wait()
