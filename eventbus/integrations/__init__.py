"""Adapters: other trainers publishing the same events as :class:`eventbus.Trainer`.

One line in the user's script, the trainer's own ``callbacks=[...]``:

* ``eventbus.integrations.lightning.EventBusCallback`` (PyTorch Lightning),
* ``eventbus.integrations.transformers.EventBusCallback`` (Hugging Face ``Trainer``),
* ``eventbus.integrations.composer.EventBusCallback`` (MosaicML Composer).

Each imports its trainer only when used; ``import eventbus`` imports none of them.
What they share (the Composer-named state, the bus) is :mod:`eventbus.integrations.adapter`.
"""
