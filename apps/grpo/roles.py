"""The RL app's roles (:class:`apps.grpo.main.RLApp`): what ``setup`` starts and teardown
stops, in order: Monarch's log in ``<output_dir>/logs``, the hosts (``hosts:``,
:mod:`forge_ext.runtime.placement`) and a watch that turns a dead process or host into one
error (:mod:`forge_ext.runtime.supervision`), the reward worker processes, torchstore, then
the model roles of :mod:`forge_ext.actors.rl_roles` (the ``RLTrainer``, the
``ReferenceModel`` unless ``reference: null``, the critic for PPO, the ``Generator``
replicas, each reward model of ``reward.functions``, attached to the rubric), spawned
concurrently on their host meshes, and ``task.agent``'s endpoint. Teardown stops the roles
(concurrently), then torchstore, then the hosts."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from forge_ext.config import apply_env
from forge_ext.evaluation import close_sets
from forge_ext.rollout.replicas import replica_name
from forge_ext.runtime import run_logs
from forge_ext.runtime.placement import Placement
from forge_ext.runtime.roles import Roles
from forge_ext.runtime.supervision import RoleFailure, watch_run


class RunRoles:
    """``setup`` and the failure hooks of :class:`forge_ext.rl.loop.RLLoop` for the RL app,
    which holds what they use: ``config``, ``tok``, ``runner``, ``rubric``, ``eval_sets``,
    ``context``, ``sample``, and the console's ``write``, ``plan_lines`` and
    ``model_name`` (:class:`apps.grpo.console.RunConsole`). Sets ``placement``, ``watch``,
    ``roles``, ``trainer_weights`` and each role's handle (``trainer``, ``reference``,
    ``critic``, ``generator``)."""

    async def setup(self) -> None:
        from forge_ext.actors.reference import base_of_trainer
        from forge_ext.actors.rl_roles import rl_role_specs, role_names, trainer_weights
        from forge_ext.compat.torchstore_monarch import RunStore

        c = self.config
        apply_env(c.procs.env)
        self.roles = roles = Roles()
        run_logs.start(c.output_dir)  # Monarch's log in <output_dir>/logs, before Monarch starts
        self.track("monarch log", functools.partial(run_logs.finish, c.output_dir))
        self.placement = placement = Placement(c.hosts, c.processes(), output_dir=c.output_dir)
        # Before anything starts: a process or host that dies is one error naming it; a
        # generator replica that dies is one warning, the others serve its requests.
        n = c.generator.replicas
        self.watch = watch_run(
            self, placement, replicas=[replica_name(r, n) for r in range(n)] if n > 1 else (),
            on_replica_death=self.replica_died,
        )
        for line in self.plan_lines(role_names(c), placement):  # model, task, roles, output
            self.write(line)
        # The reward worker processes start now, while the roles spawn (each imports its
        # functions' modules: a second or more), and end with the run.
        self.rubric.start()
        self.track("reward workers", self.stop_rewards)
        self.track("hosts", placement.stop)
        # A Slurm job waits in the queue here (Ctrl-C cancels it); Monarch's context starts
        # once its transport is set, its console line in <output_dir>/logs.
        await roles.timed("hosts", placement.start())
        # torchstore's storage volume in a proc of the run's own, stopped with it, unless a
        # role's process or host died (RunStore says why).
        store = RunStore()
        self.track("torchstore",
                   lambda: store.stop(peer_died=isinstance(self.failure, RoleFailure)))
        await roles.timed("torchstore", store.start())
        self.track("actors", self.stop_roles)
        self.trainer_weights = trainer_weights(c, placement)
        await roles.start(rl_role_specs(c, placement, tok=self.tok, weights=self.trainer_weights,
                                        ready=functools.partial(setattr, self),
                                        reward_model_ready=self.attach_reward_model))
        if self.runner.config.agent is not None:
            await self.start_agent_endpoint()
        if c.reference_is_trainer_base:
            # A LoRA policy's reference: its own frozen base, adapters disabled (docs/lora.md).
            self.reference = base_of_trainer(self.trainer)
        # Every port of the run that other machines may reach (all unauthenticated), once.
        exposed = await placement.exposed_ports(roles.meshes(first=("trainer", "generator")))
        if exposed:
            self.write(exposed)
        for line in roles.startup_lines():  # what the start-up spent (issue 38)
            self.write(line)

    def attach_reward_model(self, name: str, model: Any) -> None:
        """Reward model ``name`` scores for the rubric, and for the evaluation sets' rubrics
        that use it."""
        for rubric in (self.rubric, *(s.runner.rubric for s in self.eval_sets)):
            if name in rubric.models:
                rubric.attach_model(name, model.score)

    def stop_rewards(self) -> None:
        """The reward worker processes and the evaluation sets' end with the run."""
        self.rubric.close()
        close_sets(self.eval_sets)

    async def stop_roles(self) -> None:
        if self.failure is not None and self.placement.owns_workers:
            # A host died: stopping the roles' procs one mesh at a time would wait on it
            # (~30 s per mesh); placement.stop() (tracked before) kills every proc at once.
            return
        await self.roles.stop(self.write)

    async def start_agent_endpoint(self) -> None:
        """``task.agent``: the OpenAI-compatible endpoint over the replicas
        (:mod:`forge_ext.rollout.agents`), on 127.0.0.1; its address and the run's key go to
        ``<output_dir>/agent_endpoint.json`` (readable by this user only) for external agents."""
        from forge_ext.rollout.agents import TOOL_PARSERS, AgentEndpoint, write_address

        c, episodes = self.config, self.runner.config
        parser = episodes.agent_tool_parser
        endpoint = AgentEndpoint(
            self.sample, self.tok, model=os.path.basename(os.path.abspath(c.model.hf_path)),
            max_tokens=episodes.agent_max_tokens or self.context or 1 << 30,
            sampling=c.generator.sampling,
            tool_parser=TOOL_PARSERS.get(self.model_name()) if parser == "auto" else parser,
            chat_template_kwargs=c.prompt.chat_template_kwargs, port=episodes.agent_port,
        )
        await endpoint.start()
        self.track("agent endpoint", endpoint.stop)
        self.runner.endpoint = endpoint
        write_address(endpoint, path := Path(c.output_dir) / "agent_endpoint.json")
        self.write(f"agent endpoint {endpoint.base_url} ({episodes.agent}; address and key in "
                   f"{path})")

    def replica_died(self, name: str, cause: str, hint: str) -> None:
        """The failure watch's report of a dead generator replica (``generator.replicas >
        1``): it serves no more requests; with none left the run stops naming each."""
        if self.generator is None:  # while spawning: spawn_replicas fails with its error
            return
        self.generator.lose(self.generator.index(name), cause, hint)
        if not self.generator.live:
            self.fail(self.generator.all_lost())

    def explain_error(self, error: BaseException) -> BaseException | None:
        watch = getattr(self, "watch", None)
        return watch.explain(error) if watch is not None else None
