"""The engine: the measure protocol and registry (measure.py), the suite that runs measures over minibatches (suite.py),
the taps that read a model's tensors through its family (taps.py), the seeded minibatch order and the cross-process
reductions (reduce.py), and the sentences that tell each front end's user what to fix (fixes.py)."""
