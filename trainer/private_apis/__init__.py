"""Every private API of torch, wandb, submitit and the standard library that zerolab calls, in one place: the upgrade surface.

Each is called through a function of this package, never directly, so that a new torch or wandb
release is checked here first. Checked against torch 2.11.0 and 2.13.0 (tests/unit/private_apis/test_of_torch.py runs under both in CI), wandb 0.31.0, wandb-workspaces 0.4.13
and submitit 1.5.4 (the versions the suite runs with).

| private API | why there is no public one | called through |
|---|---|---|
| `torch._C._distributed_c10d._dump_fr_trace_json` | c10d's flight recorder has no public reader (guarded: absent in some builds) | `of_torch.flight_recorder_json` |
| `torch._C._distributed_c10d._dump_nccl_trace_json` | ProcessGroupNCCL's own flight recorder, the same format (CUDA wheels only; guarded) | `of_torch.flight_recorder_json`, `of_torch.flight_recorder_dumps` |
| `torch._ops.OpOverload`, `OpOverloadPacket`, `HigherOrderOperator` | the types of `torch.ops` entries; torch exports them from `torch._ops` only | `of_torch.OpOverload`, `of_torch.OpOverloadPacket`, `of_torch.HigherOrderOperator` |
| `torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB` | DDP's default bucket cap, a module constant (guarded: 25 where absent) | `of_torch.ddp_default_bucket_cap_mb` |
| `torch._dynamo`, `torch.distributed._tools.mem_tracker` (the modules, imported) | the fork server imports what every rank would import on first use; no public module imports them | `of_torch.import_rank_lazy_modules` |
| `torch._inductor.runtime.cache_dir_utils.default_cache_dir` | where inductor caches compiled kernels by default (`torchinductor_<user>` in the temporary directory); the public config reads it only once the cache is used, and creates it | `of_torch.inductor_cache_dir` |
| `torch.distributed._tools.mem_tracker.MemTracker` | tensor-level memory by category on CPU; torch ships no public equivalent | `of_torch.new_mem_tracker` |
| `torch.utils._python_dispatch.TorchDispatchMode`, `torch.utils._pytree.tree_leaves`, `torch.distributed._tools.common_utils.get_untyped_storages` | the CPU cap sees every op's new storages as MemTracker does (a dispatch mode, the op's outputs, a wrapper subclass's inner storages); torch documents dispatch modes but exports them from private modules only | `of_torch.TorchDispatchMode`, `of_torch.tree_leaves`, `of_torch.tensor_storages` |
| `UntypedStorage._cdata` | a storage's identity for the CPU cap's running total (views share it); no public id of a StorageImpl | `of_torch.storage_key` |
| `torch.distributed._compute_bucket_assignment_by_size`, `_DEFAULT_FIRST_BUCKET_BYTES` | DDP's reducer's own bucket assignment and its first bucket's cap (guarded: 1 MiB where absent), so the plan buckets gradients as DDP does | `of_torch.ddp_bucket_assignment` |
| the `dist` global of `torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook` (patched for one call) | powerSGD_hook's callbacks would run on gloo's worker threads, out of the memory tracker's sight and racing the next bucket; torch has no way to run them in the caller's thread or carry its thread-local state to them | `of_torch.powersgd_hook_in_this_thread` |
| `torch.distributed.elastic.rendezvous.dynamic_rendezvous.get_method_name` (replaced) | it names each rendezvous event with `inspect.stack()`, half a CPU-second of every job's launcher; torch has no switch for it | `of_torch.name_rendezvous_events_cheaply` |
| `DistributedDataParallel._set_params_and_buffers_to_ignore_for_model` | the parameters DDP leaves out of its init broadcast, buckets and all-reduce (parallel.ep's experts, each rank's own); DDP has no public argument for it (pytorch/pytorch#43690) | `of_torch.ddp_ignore_params` |
| `DistributedDataParallel._comm_hooks` | the (hook, state) pairs register_comm_hook appended, so the memory tracker can count the state a compression hook keeps between steps; DDP has no public getter | `of_torch.comm_hook_states` |
| `MemTracker._update_peak_stats`, `MemTracker.memory_tracking` | its per-module peaks, which cost a walk over every module after every op, cannot be switched off | `of_torch.global_peak_mem_tracker` |
| `torch.distributed.algorithms._checkpoint.checkpoint_wrapper` | activation checkpointing per module, as torchtitan applies it | `of_torch.checkpoint_wrapper`, `of_torch.CheckpointImpl` |
| `torch.cuda.memory._record_memory_history`, `_dump_snapshot` | the allocator's history and its snapshot for pytorch.org/memory_viz; torch documents them (docs "Understanding CUDA Memory Usage") but names them private | `of_torch.record_memory_history`, `of_torch.dump_memory_snapshot` |
| `GradScaler._found_inf_per_device` | the scaler's own record of an overflow; comparing scales misses one at the scale floor | `of_torch.found_inf_per_device` |
| `GradScaler._get_scale_async` | the scale without a host sync (`get_scale()` syncs) | `of_torch.scale_on_device` |
| `ScheduleInterleaved1F1B._calculate_single_rank_operations` | the order of one rank's forwards and backwards, which the plan needs before any stage or process group exists (a schedule object needs both) | `of_torch.interleaved_1f1b_order` |
| `DeviceMesh._flatten` | one dim of several adjacent mesh dims, so that ZeRO works over dp and cp together (torchtitan's `dp_shard_cp`); DeviceMesh has no public flatten | `of_torch.flatten_mesh` |
| `DeviceMesh._concatenate` | HSDP's 2-D mesh of its replicate dim and the flattened `dp_shard_cp`, as FSDP2 builds its own; slicing a flattened dim from the root mesh warns it will be deprecated (guarded: that slice where absent) | `of_torch.concatenate_meshes` |
| `torch.distributed._functional_collectives.all_gather_single_autograd` (2.11: `all_gather_tensor_autograd`), `all_to_all_single_autograd` | collectives with autograd that reduce-scatter and exchange gradients on gloo too, for context parallelism and expert parallelism's uneven dispatch; the public `torch.distributed.nn.functional` ones are deprecated for them, and their all-gather's backward on gloo is one scatter per rank | `of_torch.all_gather_autograd`, `of_torch.all_to_all_autograd`, `of_torch.all_to_all_uneven_autograd` |
| `LRScheduler._last_lr` | what `get_last_lr()` returns after a rewind; LambdaLR has no setter | `of_torch.set_last_lr` |
| `wandb.sdk.lib.runid.generate_id` | `wandb.util.generate_id` is gone in wandb 0.31 | `of_wandb.generate_run_id` |
| `wandb.sdk.mailbox` `MailboxClosedError`, `HandleAbandonedError` | what a call raises once the service process is gone (no public error class for it) | `of_wandb.service_lost_errors` |
| `wandb_workspaces` `Report._to_model`, `Report._from_model`, `reports.v2.internal.ReportViewspec` | the Report's serialised form, offline (the library saves it only to a server) | `of_wandb.report_json`, `of_wandb.report_from_json` |
| `submitit.JobEnvironment._usr_sig` | the signal submitit's requeue handler is installed for | `of_submitit.requeue_signal` |
| `multiprocessing.forkserver._forkserver._forkserver_alive_fd` | a forked process's copy of the fork server's alive pipe, which keeps the server (and so its children) alive after the job process dies; the module has no public way to drop it | `of_python.close_inherited_fork_server_alive_fd` |

- of_torch.py, of_wandb.py, of_submitit.py, of_python.py: the calls above, one module per library (of_python.py: the
  standard library's).

Split by library so that a launched rank, which imports `of_torch`, never imports wandb
(tests/unit/test_imports.py).
"""
