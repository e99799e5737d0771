"""Model adaptation: an unmodified Flax NNX model seen as a staged one.

The repeated blocks found and stacked (:mod:`.blocks`), the model's own forward split around
them by stand-ins (:mod:`.standins`, :mod:`.scanned` for models that scan their own stack),
what else the blocks read carried as side inputs (:mod:`.side_inputs`), layout-independent
dropout (:mod:`.dropout`), all joined by :mod:`.adapt`; :mod:`.split` is the one entry point.
"""
