"""Pass strategies: how the target's verification pass runs (eager, static cache, compiled,
saved graphs) - :mod:`~medusa.decoding.passes.strategies`; the saved compiled passes on disk -
:mod:`~medusa.decoding.passes.saved`; building them ahead of time - :mod:`~medusa.decoding.passes.build`."""
