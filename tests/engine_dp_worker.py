"""One rank of a data-parallel engine run on gloo, for ``test_engine.py``'s DP=2 test
(started with ``torch.multiprocessing``, spawn: a fresh interpreter per rank).

For each backend's config, in one process pair (the imports cost ~13 s a process here):
a step at GA 2 on this rank's half of the batch (loss, gradients, grad norm, weights),
a checkpoint, the next step, a fresh engine resuming from the checkpoint and taking that
step again, fixed rows against a token budget on the same weights, what
``get_per_tensor_param`` yields against ``hf_state_dict``, a full-tensor
``load_model_state_dict``, and each mode context's ``module.training``. With LoRA
(``lora`` in the config) the adapters are set to ``adapters`` first. Rank 0 writes the
results to ``<out>/<backend>.pt``; every rank writes its mode flags to
``<out>/<backend>-modes-<rank>.pt``.
"""

import os


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _grads(engine):
    return {n: _full(p.grad).clone() for n, p in engine.model_parts[0].named_parameters()
            if p.grad is not None}


def _weights(engine):
    return {k: _full(v).clone() for k, v in engine.hf_state_dict().items()}


def run(rank: int, world: int, port: int, configs: dict, batches: list, out: str,
        adapters: dict) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import forge_ext  # noqa: F401  (before torchtitan: the CPU device)
    import torch

    torch.set_num_threads(1)
    from forge_ext.engine import build_engine, cross_entropy_loss, valid_tokens

    rows = len(batches[0]["input_ids"]) // world
    local = [{k: v[rank * rows:(rank + 1) * rows] for k, v in b.items()} for b in batches]
    for backend, config in configs.items():
        engine = build_engine(config)
        if engine.lora_enabled:  # the same adapters as the one-process engine, B non-zero
            engine.load_adapter_state_dict(adapters)
        modes = {"outside": [m.training for m in engine.model_modules()]}
        for mode in ("train", "eval"):
            with getattr(engine, f"{mode}_mode")():
                modes[mode] = [m.training for m in engine.model_modules()]
        modes["after"] = [m.training for m in engine.model_modules()]
        torch.save(modes, f"{out}/{backend}-modes-{rank}.pt")

        result = {"dp_size": engine.dp_size}
        engine.optimizer_zero_grad()
        fb = engine.forward_backward_batch(engine.microbatches(local[0]), cross_entropy_loss,
                                           valid_tokens)
        result["step1"] = {"loss": fb.loss, "global_weight": fb.global_weight,
                           "grads": _grads(engine), "grad_norm": engine.optimizer_step()}
        engine.lr_scheduler_step()
        result["step1"]["weights"] = _weights(engine)
        engine.save_checkpoint(engine.step)
        result["step2"] = engine.train_batch(local[1], cross_entropy_loss, valid_tokens)
        result["step2_weights"] = _weights(engine)

        resumed = build_engine(config)
        result["resumed_step"] = resumed.load_checkpoint()
        result["resumed"] = resumed.train_batch(local[1], cross_entropy_loss, valid_tokens)
        result["resumed_weights"] = _weights(resumed)

        # Fixed rows (GA 2) against a token budget, same weights, same batch.
        training = resumed.config.training
        splits = {}
        for name, budget in (("rows", None), ("budget", 48)):
            training.max_tokens_per_microbatch = budget
            resumed.optimizer_zero_grad()
            mbs = resumed.microbatches(local[2])
            fb = resumed.forward_backward_batch(mbs, cross_entropy_loss, valid_tokens)
            splits[name] = {"loss": fb.loss, "grads": _grads(resumed), "count": len(mbs)}
        training.max_tokens_per_microbatch = None
        result["splits"] = splits

        expected = resumed.adapter_state_dict() if resumed.lora_enabled else _weights(resumed)
        tensors, adapter_config = resumed.get_per_tensor_param()
        yielded = [(name, tensor.clone()) for name, tensor in tensors]
        result["per_tensor"] = {
            "names": [n for n, _ in yielded] == list(expected),
            "equal": all(torch.equal(t, expected[n]) for n, t in yielded),
            "adapter_config": adapter_config,
            "sharded_types": sorted({type(t).__name__ for _, t in
                                     resumed.get_per_tensor_param(sharded=True)[0]}),
        }
        changed = {k: v + 0.5 for k, v in _weights(resumed).items()}
        resumed.load_hf_state_dict(changed)
        result["load_full"] = all(torch.equal(v, changed[k])
                                  for k, v in _weights(resumed).items())
        for e in (engine, resumed):
            e.close()
        if rank == 0:
            torch.save(result, f"{out}/{backend}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
