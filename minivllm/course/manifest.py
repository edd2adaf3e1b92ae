"""The course's task list: what each assignment asks for, and which tests grade it.

One ordered tuple, :data:`TASKS`, drives everything else in the course kit:

- ``minivllm course make-student DIR`` stubs out, in a copy of ``minivllm/ref``,
  the functions each task names (:mod:`minivllm.course.student`);
- ``pytest -m task_<name>`` or ``pytest --task <name>`` selects a task's
  tests (the pytest plugin tags every test from :attr:`Task.tests`);
- ``minivllm course grade`` scores them (:mod:`minivllm.course.grade`);
- ``minivllm course selfcheck`` checks that realistic buggy versions fail them
  (:mod:`minivllm.course.mutants`);
- ``docs/course/`` holds one handout page per task (a test keeps them in sync).

A task's tests are pytest node-id prefixes relative to the repository root:
``"tests/test_x.py"`` (a whole file), ``"tests/test_x.py::test_y"`` (a test
and all its parametrisations) or ``"tests/test_x.py::TestMachine"`` (a class).
Tests are never edited to belong to a task; the manifest attaches them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from minivllm.backend import COMPONENTS


@dataclass(frozen=True)
class Task:
    """One assignment.

    Args:
        name: short id; its tests carry the pytest marker ``task_<name>``.
        title: one line for tables and handouts.
        component: the swap-layer component the task's code serves (``backend.COMPONENTS``).
        module: the file the code lives in (``<module>.py`` in the ref and in the
            student package); so far always the component's own module.
        functions: what the student writes: ``"func"`` or ``"Class.method"``.
            Each has a ``# BEGIN SOLUTION`` / ``# END SOLUTION`` region in the solution.
        tests: pytest node-id prefixes of the grading tests.
        points: the task's weight in the score (all or nothing).
        reading: docs or tutorials to read first, relative to the repository root.
        requires: other module attributes the engine reads (constants), checked
            to exist before grading.
        source: which package holds the solution: ``"ref"``, or ``"fast"`` for
            kernel tasks (their stubs keep the launch code and drop the kernel body).
        groups: partial credit: ``(label, selectors, points)`` triples, each
            scored on its own (all its tests pass, or 0). The selectors are some
            of ``tests``; the points add up to ``points``. Empty (the default):
            the task is one group, all or nothing.
        exclude: node-id prefixes under ``tests`` that do not grade this task
            (tests of one implementation, which skip for any other).
        csrc: C++ sources (under ``minivllm/<source>/csrc/``) with ``// BEGIN
            SOLUTION`` / ``// END SOLUTION`` regions, copied stubbed into the
            package's ``csrc/`` (with ``csrc_headers`` as they are).
    """

    name: str
    title: str
    component: str
    module: str
    functions: tuple[str, ...]
    tests: tuple[str, ...]
    points: int
    reading: tuple[str, ...]
    requires: tuple[str, ...] = ()
    source: str = "ref"
    groups: tuple[tuple[str, tuple[str, ...], int], ...] = ()
    exclude: tuple[str, ...] = ()
    csrc: tuple[str, ...] = ()
    csrc_headers: tuple[str, ...] = ()
    number: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if self.component not in COMPONENTS:
            raise ValueError(f"task {self.name!r}: component must be one of "
                             f"{sorted(COMPONENTS)}, got {self.component!r}")
        if self.source not in ("ref", "fast"):
            raise ValueError(f"task {self.name!r}: source must be 'ref' or 'fast', "
                             f"got {self.source!r}")
        if self.points < 1:
            raise ValueError(f"task {self.name!r}: points must be >= 1, got {self.points}")
        if self.groups:
            total = sum(points for _, _, points in self.groups)
            if total != self.points:
                raise ValueError(f"task {self.name!r}: groups' points add up to {total}, "
                                 f"not points={self.points}")
            unknown = [s for _, sel, _ in self.groups for s in sel if s not in self.tests]
            if unknown:
                raise ValueError(f"task {self.name!r}: group selectors {unknown} are not in "
                                 f"its tests")

    @property
    def marker(self) -> str:
        """The pytest marker its tests carry (``pytest -m task_<name>``)."""
        return f"task_{self.name}"

    @property
    def top_level_names(self) -> tuple[str, ...]:
        """Module attributes the task's module must define (functions, classes, constants)."""
        names = [f.split(".")[0] for f in self.functions] + list(self.requires)
        return tuple(dict.fromkeys(names))


HOST = "docs/host_side.md"
KERNELS = "docs/kernels.md"
_T01 = "tutorials/01_paged_kv_cache.py"
_T02 = "tutorials/02_forward_pass.py"
_T03 = "tutorials/03_continuous_batching.py"
_T04 = "tutorials/04_flash_decoding.py"
_T05 = "tutorials/05_kernel_fusion.py"
_T06 = "tutorials/06_tensor_parallel.py"
_ALLOC = "tests/test_block_allocator.py"
_SCHED = "tests/test_scheduler.py"
_SMALL = "tests/test_small_kernels.py"
_SAMPLER = "tests/test_sampler.py"
_LORA = "tests/test_lora_kernels.py"

_TASKS = (
    Task("allocator", "Block allocator: allocate, free, reference counts", "block_allocator",
         "block_allocator", ("BlockAllocator.allocate", "BlockAllocator.free",
                             "BlockAllocator.touch"),
         ("tests/course/test_task_allocator.py", f"{_ALLOC}::test_shared_block_needs_every_owner_to_free_it",
          f"{_ALLOC}::test_bad_input", f"{_ALLOC}::TestAllocatorMachine"),
         10, (HOST, _T01)),
    Task("prefix_caching", "Prefix caching: cached blocks, hits, LRU eviction", "block_allocator",
         "block_allocator", ("BlockAllocator.lookup_cached_blocks",
                             "BlockAllocator.cache_full_block", "BlockAllocator.reset_prefix_cache",
                             "BlockAllocator._evict"),
         ("tests/course/test_task_prefix_caching.py", f"{_ALLOC}::test_freed_blocks_stay_cached_and_hit",
          f"{_ALLOC}::test_hit_stops_at_first_miss", f"{_ALLOC}::test_lru_eviction_order",
          f"{_ALLOC}::test_caching_disabled_never_hits", f"{_ALLOC}::test_duplicate_hash_keeps_first_copy",
          f"{_ALLOC}::test_reset_prefix_cache_only_when_idle", f"{_ALLOC}::TestAllocatorMachine"),
         10, (HOST, _T01)),
    Task("block_table", "Block tables and slot mapping", "block_table", "block_table",
         ("BlockTables.append_blocks", "BlockTables.block_table_tensor", "BlockTables.slot_mapping"),
         ("tests/test_block_table.py", "tests/course/test_task_block_table.py"),
         8, (HOST, _T01)),
    Task("kv_cache_manager", "KV cache manager: prefix hits and slots for a request",
         "kv_cache_manager", "kv_cache_manager",
         ("KVCacheManager.get_computed_blocks", "KVCacheManager.allocate_slots",
          "KVCacheManager.free", "KVCacheManager._block_hashes", "KVCacheManager._cache_full_blocks"),
         ("tests/course/test_task_kv_cache_manager.py", "tests/test_kv_cache_manager.py"),
         10, (HOST, _T03)),
    Task("scheduler", "Scheduler: token budget, FCFS, chunked prefill, preemption", "scheduler",
         "scheduler", ("Scheduler.schedule", "Scheduler._preempt", "Scheduler.update_from_output"),
         ("tests/course/test_task_scheduler.py", _SCHED),
         15, (HOST, _T03),
         groups=(("rules", ("tests/course/test_task_scheduler.py",), 7),
                 ("same decisions as the ref", (_SCHED,), 8))),
    Task("rms_norm", "RMSNorm", "layernorm", "layernorm", ("rms_norm",),
         ("tests/course/test_task_rms_norm.py",
          f"{_SMALL}::test_rms_norm", f"{_SMALL}::test_rms_norm_rejects_bad_weight"),
         5, (KERNELS, _T02, _T05)),
    Task("fused_add_rms_norm", "Residual add fused with RMSNorm", "layernorm", "layernorm",
         ("fused_add_rms_norm",),
         ("tests/course/test_task_fused_add_rms_norm.py",
          f"{_SMALL}::test_fused_add_rms_norm"),
         3, (KERNELS, _T05)),
    Task("rope", "Rotary position embedding (NeoX and GPT-J pairing)", "rotary", "rotary",
         ("apply_rotary_emb", "_rotate"),
         ("tests/course/test_task_rope.py", f"{_SMALL}::test_apply_rotary_emb",
          f"{_SMALL}::test_rotary_on_qkv_views"),
         5, (KERNELS, _T02)),
    Task("silu_and_mul", "SiLU-and-mul (the gated MLP activation)", "activation", "activation",
         ("silu_and_mul",), (f"{_SMALL}::test_silu_and_mul", "tests/course/test_task_silu_and_mul.py"),
         2, (KERNELS, _T05)),
    Task("cache_write", "Writing K/V into the paged cache", "cache_write", "cache_write",
         ("reshape_and_cache",), ("tests/course/test_task_cache_write.py", f"{_SMALL}::test_reshape_and_cache",
          f"{_SMALL}::test_reshape_and_cache_strided_input"),
         4, (KERNELS, _T04)),
    Task("paged_attention", "Paged attention over prefills, chunks and decodes (GQA)", "attention",
         "attention", ("gather_kv", "paged_attention"),
         ("tests/course/test_task_paged_attention.py", "tests/test_attention.py"),
         15, (KERNELS, _T04),
         exclude=("tests/test_attention.py::test_many_partitions_merge",)),  # the Triton kernel's
    Task("sampler_filters", "Sampling filters: temperature, min-p, top-k, top-p", "sampler",
         "sampler", ("filter_logits", "apply_min_p", "apply_top_k", "apply_top_p"),
         ("tests/course/test_task_sampler_filters.py", f"{_SAMPLER}::test_filters_match_oracle"),
         8, ("docs/sampling.md",)),
    Task("sampler_penalties", "Sampling: penalties, greedy, seeds, logprobs", "sampler", "sampler",
         ("sample", "apply_penalties", "gather_logprobs"),
         ("tests/course/test_task_sampler_penalties.py", f"{_SAMPLER}::test_sampled_tokens_pass_the_filters",
          f"{_SAMPLER}::test_distribution_chi_square",
          f"{_SAMPLER}::test_penalties_match_oracle", f"{_SAMPLER}::test_greedy_is_argmax",
          f"{_SAMPLER}::test_min_tokens_masks_eos_and_stop_ids",
          f"{_SAMPLER}::test_logprobs_are_raw_log_softmax", f"{_SAMPLER}::test_seeded_request_ignores_batch"),
         8, ("docs/sampling.md",)),
    Task("tp_linear", "Tensor-parallel column, row and vocabulary layers", "linear", "linear",
         ("ColumnParallelLinear.weight_loader", "ColumnParallelLinear._per_rank_outputs",
          "ColumnParallelLinear._gather", "QKVParallelLinear._rows_for_rank",
          "QKVParallelLinear.forward", "RowParallelLinear.forward",
          "VocabParallelEmbedding.forward", "ParallelLMHead.forward"),
         ("tests/course/test_task_tp_linear.py", "tests/test_linear.py"),
         10, ("docs/tensor_parallel.md", _T06), requires=("SIMULATES_ALL_RANKS",)),
    Task("triton_decode", "Flash-decoding in Triton: the online softmax over a partition",
         "attention", "attention_decode", ("_paged_decode_kernel",),
         ("tests/course/test_task_triton_decode.py",),
         10, (KERNELS, _T04), source="fast"),
    Task("cpp_silu_and_mul", "A C++ CPU op: SiLU-and-mul through torch.utils.cpp_extension",
         "activation", "activation_cpp", ("silu_and_mul",),
         ("tests/course/test_task_cpp_silu_and_mul.py",),
         5, (KERNELS, _T05, "minivllm/fast/cpu_ops.py"), source="fast",
         csrc=("activation.cpp",), csrc_headers=("ops.h", "thread_team.h", "thread_team.cpp")),
    Task("int8_gemv", "int8 weights: quantize, dequantize, and a GEMV", "quantization",
         "quantization", ("quantize_int8", "dequantize_int8", "int8_gemv"),
         ("tests/course/test_task_int8_gemv.py",
          "tests/test_quantization.py::test_int8_round_trip_error_is_at_most_half_a_step",
          "tests/test_quantization.py::test_int8_per_group_and_gemv"),
         5, ("docs/quantization.md", "tutorials/09_bytes_per_weight.py")),
    Task("rejection_sampler", "Speculative decoding: the rejection sampler", "rejection_sampler",
         "rejection_sampler", ("verify_greedy", "verify_random"),
         ("tests/test_rejection_sampler.py",), 8,
         ("docs/speculative_decoding.md", "tutorials/11_speculative_decoding.py"),
         exclude=("tests/test_rejection_sampler.py::test_triton_kernel_equals_ref_exactly",)),
    Task("fork_cow", "Fork and copy-on-write in the block table", "kv_cache_manager",
         "kv_cache_manager", ("KVCacheManager.fork", "KVCacheManager._shared_blocks_written",
                              "KVCacheManager._copy_on_write"),
         ("tests/test_fork_cow.py", "tests/test_fork_cow_rules.py",
          "tests/test_fork_cow_cache.py::test_the_manager_alone_keeps_every_sequence_intact"),
         8, ("docs/sharing.md", "tutorials/12_sharing_blocks.py")),
    Task("token_mask", "Structured outputs: the DFA walk that builds a token mask",
         "structured_output", "structured_output", ("token_mask",),
         ("tests/course/test_task_token_mask.py", "tests/test_structured_output.py",
          "tests/test_structured_output_api.py"),
         6, ("docs/structured_outputs.md", "tutorials/13_constrained_decoding.py")),
    Task("lora_delta", "LoRA: the delta for a batch of mixed adapters", "lora", "lora",
         ("add_lora",),
         ("tests/course/test_task_lora_delta.py", f"{_LORA}::test_add_lora_matches_oracle",
          f"{_LORA}::test_long_segments_and_many_slots",
          f"{_LORA}::test_no_adapter_anywhere_is_a_no_op",
          f"{_LORA}::test_y_with_strided_rows_is_updated_in_place"),
         6, ("docs/lora.md", "minivllm/lora/mapping.py", "tutorials/14_many_fine_tunes.py")),
)

#: Every task, in the order a course takes them; ``task.number`` is 1-based.
TASKS: tuple[Task, ...] = tuple(
    replace(t, number=i) for i, t in enumerate(_TASKS, start=1)
)

def get_task(name: str) -> Task:
    """The task called ``name``; ``ValueError`` listing the names otherwise."""
    for task in TASKS:
        if task.name == name:
            return task
    raise ValueError(f"unknown task {name!r}; the tasks are: {', '.join(t.name for t in TASKS)}")


def nodeid_matches(nodeid: str, pattern: str) -> bool:
    """True if pytest node id ``nodeid`` is ``pattern`` or lies under it."""
    if nodeid == pattern:
        return True
    return nodeid.startswith(pattern) and nodeid[len(pattern)] in ":["


def tasks_for_nodeid(nodeid: str) -> list[Task]:
    """The tasks a test belongs to (a test may grade several, e.g. a state machine)."""
    return [t for t in TASKS if any(nodeid_matches(nodeid, p) for p in t.tests)
            and not any(nodeid_matches(nodeid, p) for p in t.exclude)]


def total_points() -> int:
    """The score of a package that passes every task."""
    return sum(t.points for t in TASKS)


def missing_for_task(package: str, task: Task) -> str | None:
    """Why import path ``package`` cannot be graded on ``task``, or None if it can.

    The package must serve the task's component itself (a submodule or an
    attribute named after it: the swap layer would otherwise fall back to the
    ref, and the tests would grade the ref), and that module must define the
    task's public functions, classes and methods, and must not break a
    contract that changed since an older handout
    (:func:`minivllm.course.contracts.contract_break`).
    """
    where = f"task {task.number} ({task.name})"
    try:
        return _missing(package, task, where)
    except Exception as e:  # a syntax error, a failing import inside the package
        return f"importing {package!r} for {where} failed: {type(e).__name__}: {e}"


def _missing(package: str, task: Task, where: str) -> str | None:
    import importlib

    from minivllm import backend

    if not backend.provides(package, task.component):
        return (f"{package!r} does not provide the {task.component!r} component that {where} "
                f"grades: add a submodule {package}.{task.component} or an attribute "
                f"{task.component!r} (see docs/course/README.md)")
    mod = backend.get(task.component, package)
    if task.module != task.component:
        try:
            mod = importlib.import_module(f"{package}.{task.module}")
        except ModuleNotFoundError:
            return f"{where} needs the module {package}.{task.module}, which does not exist"
    for name in task.functions + task.requires:
        if any(part.startswith("_") for part in name.split(".")):
            continue  # private helpers are the student's own business
        obj = mod
        for part in name.split("."):
            if not hasattr(obj, part):
                return (f"{backend.provider_name(mod)} has no attribute {name!r}, which {where} "
                        f"needs")
            obj = getattr(obj, part)
    from minivllm.course.contracts import contract_break

    return contract_break(mod, task.component, where)
