"""The one place that knows about torch versions and torch's private modules, and torch's process-wide switches.

Everything version-specific or private lives in this package, so a torch upgrade touches only it.
So does every switch that changes torch for the whole process (the default dtype, the intra-op
thread count, the global optimizer hooks, ``nn.Module`` patches): each is one named helper that
says why and restores what it changed. The process-wide switches that are not torch's (exception
hook, signals, exit handlers) are in :mod:`minifabric.process`.

One module per seam; import the names from here:

- :mod:`.versions`: the supported torch range.
- :mod:`.switches`: process-wide switches training sets (default dtype, threads, malloc, optimizer hooks).
- :mod:`.init`: what meta-device init needs (module patches, storage keys, the seeded-op probe, frame walks).
- :mod:`.distributed`: private ``torch.distributed`` (FSDP2 policy, DTensor layouts, store, fake worlds,
  the end-of-backward callback).
- :mod:`.philox`: one range of a dense random fill on CUDA, drawn alone (ATen's Philox round arithmetic).
- :mod:`.serialization`: private ``torch.serialization`` and DCP's file layout.
- :mod:`.compiled`: ``torch.compile`` wrappers.
"""

from __future__ import annotations

from torch.utils._pytree import tree_flatten, tree_map

from minifabric._torch.compiled import compile_in_place, split_compiled
from minifabric._torch.distributed import (
    activations_checkpointed,
    at_backward_end,
    checkpoint_activations,
    default_store,
    differentiable_all_gather,
    fake_tensor_mode,
    fake_world,
    fsdp_policy,
    group_timeout,
    inside_distribute_module,
    laid_out_like,
    load_post_hooks_are_fsdps,
    load_pre_hooks_keep_nothing,
    local_box,
    local_slice,
    memory_tracker,
    unresolved_plan_keys,
    with_local,
)
from minifabric._torch.init import (
    module_construction_hook,
    module_registration_hooks,
    refusing_writes,
    seeded_op_probe,
    storage_key,
    swap_module_tensors,
    swapping_module_params,
    tensor_version,
    torch_init_call,
)
from minifabric._torch.philox import dense_fill, draw_part
from minifabric._torch.serialization import dcp_storage_info, save_without_crc32
from minifabric._torch.switches import (
    TUNE_MALLOC_VAR,
    default_dtype,
    forget_unscale,
    intra_op_threads,
    register_global_step_pre_hook,
    return_freed_memory,
    track_scheduler_steps,
)
from minifabric._torch.versions import MIN_TORCH_VERSION, check_torch_version

__all__ = [
    "MIN_TORCH_VERSION",
    "TUNE_MALLOC_VAR",
    "activations_checkpointed",
    "at_backward_end",
    "check_torch_version",
    "checkpoint_activations",
    "compile_in_place",
    "dcp_storage_info",
    "default_dtype",
    "default_store",
    "dense_fill",
    "differentiable_all_gather",
    "draw_part",
    "fake_tensor_mode",
    "fake_world",
    "forget_unscale",
    "fsdp_policy",
    "group_timeout",
    "inside_distribute_module",
    "intra_op_threads",
    "laid_out_like",
    "load_post_hooks_are_fsdps",
    "load_pre_hooks_keep_nothing",
    "local_box",
    "local_slice",
    "memory_tracker",
    "module_construction_hook",
    "module_registration_hooks",
    "refusing_writes",
    "register_global_step_pre_hook",
    "return_freed_memory",
    "save_without_crc32",
    "seeded_op_probe",
    "split_compiled",
    "storage_key",
    "swap_module_tensors",
    "swapping_module_params",
    "tensor_version",
    "torch_init_call",
    "track_scheduler_steps",
    "tree_flatten",
    "tree_map",
    "unresolved_plan_keys",
    "with_local",
]
