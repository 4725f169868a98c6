"""How a policy version travels from the trainer's ranks to its readers: one class per
transport behind :class:`~forge_ext.weights.transports.base.Transport`, chosen by name in
:mod:`~forge_ext.weights.transports.registry`."""
