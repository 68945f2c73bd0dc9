"""The training process's side of the bus, for any trainer (torch).

Whatever trains -- the project's :class:`~eventbus.training.trainer.Trainer`, or
an adapter callback inside Composer, Lightning or Hugging Face ``Trainer`` --
hands the bus the same thing at each event: an object with Composer's State
names (:class:`~eventbus.capture.source.CaptureSource`), passed to
:meth:`EventCapture.publish <eventbus.capture.event_capture.EventCapture.publish>`.
:func:`~eventbus.capture.session.open_bus` binds the publisher and returns
that capture; everything after it (bus thread, journal, wire) is shared.
"""
