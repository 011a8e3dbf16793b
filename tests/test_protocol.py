"""What crosses between the kernel and its ranks: functions keep the file names of the cells that defined them."""

from __future__ import annotations

import traceback

import cloudpickle

from cs336_parallel import protocol

CELL = "/tmp/ipykernel_1234/2741263458.py"  # the file name IPython gives a notebook cell's code
SOURCE = '''
def outer(x):
    def inner(y):
        return [1 / z for z in y]
    return inner([x])
'''


def test_a_shipped_function_keeps_the_file_name_of_its_cell_and_of_the_code_inside_it():
    """Whatever the pickler does with `co_filename` (cloudpickle 3.1.3 sets it to "<dynamic-code>"), the rank
    gets the cell's file name, so a traceback there points at the learner's cell and line."""
    namespace: dict = {"__name__": "__main__"}
    exec(compile(SOURCE, CELL, "exec"), namespace)
    shipped = cloudpickle.loads(protocol.dumps(namespace["outer"]))
    assert shipped(2.0) == [0.5]
    try:
        shipped(0.0)
    except ZeroDivisionError as exc:
        frames = traceback.extract_tb(exc.__traceback__)[1:]
    assert [(f.filename, f.lineno, f.name) for f in frames[:2]] == [(CELL, 5, "outer"), (CELL, 4, "inner")]
    assert all(f.filename == CELL for f in frames)  # the list comprehension too, where it has a frame of its own


def test_a_cached_notebook_function_travels_as_its_function_with_a_cache_of_its_own():
    """`functools.cache` on a notebook's function: honest code, which a rank must be able to run."""
    import functools

    namespace: dict = {"__name__": "__main__", "functools": functools}
    exec(compile("@functools.cache\ndef square(x):\n    return x * x\n", CELL, "exec"), namespace)
    namespace["square"](3)
    shipped = cloudpickle.loads(protocol.dumps(namespace["square"]))
    assert shipped(4) == 16 and shipped.cache_info().currsize == 1 and shipped.__wrapped__.__code__.co_filename == CELL
