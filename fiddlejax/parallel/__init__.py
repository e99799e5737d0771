"""One module per parallel concern, each a :class:`~.concern.Concern` folded in a fixed order by
:mod:`.compose`.

- :mod:`.tensor`: Megatron splits over ``tensor`` and the padded vocabulary;
- :mod:`fiddlejax.pipeline` (its own package): stages over ``pipe`` and the schedules;
- :mod:`.zero`: ``data`` as a store (ZeRO-1/2, FSDP);
- :mod:`.data`: ``data`` as replicas (each replica's sums, their exact reduction);
- :mod:`.exchange`: how a step exchanges them (dense, top-k, PipeDream-2BW), picked once;
- :mod:`.context`, :mod:`.sequence`, :mod:`.expert`: the axes that wrap the model;
- :mod:`.concern`: the protocol and the fold; :mod:`.compose`: the order;
  :mod:`.layout`: the resulting :class:`~.layout.Layout`.

This package's ``__init__`` imports nothing, so its modules import one another one way.
"""
