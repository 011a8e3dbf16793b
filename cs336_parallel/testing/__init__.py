"""The notebooks' test code: for each notebook, the drivers its tests run on the ranks and the checks that judge
what comes back, in one module named for the notebook's topic (`collectives` for 01_collectives, ...).

A *driver* runs on a rank, in the student's processes: it gets the exercise and that rank's own share of the
test's data as arguments, calls the exercise, and returns what happened as plain data (tensors, numbers, a
`probes.count_collectives()` record, `probes.outcome(...)` for a call that may raise). It never compares.
A *check* runs on the test's side: it draws the data (`checks.generator()`), runs a driver on the ranks
(`checks.run(..., per_rank=...)`), computes the expected values itself, and compares, naming the case.

Test cells import what they use from here; the drivers cross to the ranks by name, as functions of the package.
"""
