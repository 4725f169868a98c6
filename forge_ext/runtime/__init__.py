"""Where a run's processes run and what a run writes.

- :mod:`~forge_ext.runtime.hosts`: the ``hosts:`` section (launcher, hosts per role);
- :mod:`~forge_ext.runtime.placement`: the host meshes and proc meshes per role it names;
- :mod:`~forge_ext.runtime.reaper`: the watchdog that kills helper processes their owner
  leaves behind;
- :mod:`~forge_ext.runtime.roles`: a run's roles as a declarative list, spawned, timed, stopped;
- :mod:`~forge_ext.runtime.supervision`: a dead process or host as one error;
- :mod:`~forge_ext.runtime.interrupts`: a stop from outside (Ctrl-C, SIGTERM) and the exit
  status it gives (130, 143);
- :mod:`~forge_ext.runtime.ports`: the ports a run's processes listen on;
- :mod:`~forge_ext.runtime.run_logs`: Monarch's log and each role's log in ``output_dir``;
- :mod:`~forge_ext.runtime.metrics`: TensorBoard, ``metrics.jsonl`` and the plot;
- :mod:`~forge_ext.runtime.disk`: writes that fail (a full disk) as one line;
- :mod:`~forge_ext.runtime.clock`: busy and idle seconds of a role (the loop's, an engine's).
"""
