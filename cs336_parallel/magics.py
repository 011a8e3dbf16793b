"""`%cluster` and `%%ranks`: start a group of ranks from a notebook and run cells on every rank. Also the test
cells' magic (`%%test`, cs336_parallel.testcell), `%grade`, and `%cs336_call`, by which the
grader's process reaches the exercises in this kernel (cs336_parallel.boundary)."""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from . import testcell
from .cluster import Cluster, set_session_cluster
from .errors import unfilled_exercise_hint

REPOSITORY = Path(__file__).resolve().parent.parent  # the course's repository, or a student edition


def _pushable(value) -> bool:
    """Functions, classes and modules travel to the ranks: the notebook's own by value, imported ones by name
    (`from cs336_parallel.regions import copy_to_tp_region` in the notebook, then a `%%ranks` cell uses it)."""
    return inspect.ismodule(value) or inspect.isfunction(value) or inspect.isclass(value) or inspect.isbuiltin(value)


def names_to_push(source: str, user_ns: dict) -> dict:
    """The notebook's functions, classes and modules (its own and imported ones) that `source` uses without
    defining them."""
    tree = ast.parse(source)
    loaded, stored = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (stored if isinstance(node.ctx, ast.Store) else loaded).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stored.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            stored.update((a.asname or a.name).split(".")[0] for a in node.names)
    return {name: user_ns[name] for name in sorted(loaded - stored)
            if name in user_ns and _pushable(user_ns[name])}


def cpu_fallback_note(world_size: int, backend: str, gpus: int) -> str | None:
    """One line when a machine that has GPUs runs the ranks on its CPU: fewer GPUs than ranks."""
    if backend != "gloo" or not 0 < gpus < world_size:
        return None
    return (f"{world_size} ranks on CPU (gloo): this machine has {gpus} GPU{'s' * (gpus > 1)}; "
            "NCCL needs one GPU per rank")


def explain_unfilled_exercise(shell, etype, value, tb, tb_offset=None) -> list[str]:
    """IPython's handler for NotImplementedError: the usual traceback, plus which exercise to fill."""
    stb = shell.InteractiveTB.structured_traceback(etype, value, tb, tb_offset=tb_offset)
    frames = traceback.extract_tb(tb)
    if frames:
        message = "".join(traceback.format_exception_only(etype, value)).strip()
        stb += unfilled_exercise_hint(frames[-1].name, message)
    shell._showtraceback(etype, value, stb)  # IPython leaves the display to the handler
    return stb


def grade_command(notebook: str, repository: Path = REPOSITORY) -> tuple[list[str], Path]:
    """What `%grade` runs, and where: the hidden tests where the course's repository holds them (grading/), else
    (a student edition, a hosted install) the notebook's visible tests (cs336_parallel.selfcheck)."""
    if (repository / "grading" / "cli.py").exists():
        return [sys.executable, "-m", "grading", "selfgrade", notebook], repository
    return [sys.executable, "-m", "cs336_parallel.selfcheck", notebook], Path(notebook).parent


@magics_class
class ClusterMagics(Magics):
    cluster_: Cluster | None = None

    @magic_arguments()
    @argument("action", choices=["start", "status", "restart", "shutdown"])
    @argument("-n", "--nproc", type=int, default=4, help="number of ranks (world size)")
    @argument("--backend", default="auto", help="auto (NCCL if there is a GPU per rank, else gloo), gloo or nccl")
    @argument("--timeout", type=float, default=60.0, help="seconds a call may take before it is stopped")
    @line_magic
    def cluster(self, line: str) -> None:
        """%cluster start -n 4 [--backend gloo] [--timeout 30] | status | restart | shutdown"""
        args = parse_argstring(self.cluster, line)
        if args.action == "start":
            if self.cluster_ is not None:
                self.cluster_.shutdown()
            t0 = time.perf_counter()
            try:
                self.cluster_ = Cluster(args.nproc, backend=args.backend, timeout=args.timeout)
            except ValueError as e:
                raise UsageError(str(e)) from None
            set_session_cluster(self.cluster_.start())
            note = cpu_fallback_note(args.nproc, self.cluster_.backend, torch.cuda.device_count())
            if note and args.backend == "auto":
                print(note)
            print(f"Started {args.nproc} ranks ({self.cluster_.backend}) in {time.perf_counter() - t0:.1f} s.")
            return
        cluster = self._require()
        if args.action == "status":
            for s in cluster.status():
                print(f"rank {s['rank']}: pid {s['pid']}, {s['device']}, {'alive' if s['alive'] else 'dead'}")
        elif args.action == "restart":
            t0 = time.perf_counter()
            cluster.restart()
            print(f"Restarted {cluster.world_size} ranks in {time.perf_counter() - t0:.1f} s.")
        else:
            cluster.shutdown()
            print(f"Stopped {cluster.world_size} ranks.")

    @magic_arguments()
    @argument("--ranks", default=None, help="comma-separated ranks to run on (default: all)")
    @argument("--timeout", type=float, default=None, help="seconds before the cell is stopped")
    @cell_magic
    def ranks(self, line: str, cell: str) -> None:
        """Run the cell on every rank, each in its own persistent namespace (torch, dist, rank,
        world_size and device are predefined; the notebook's functions, classes and modules that
        the cell uses are sent along). Output is shown per rank, in rank order."""
        args = parse_argstring(self.ranks, line)
        cluster = self._require()
        try:
            ranks = None if args.ranks is None else [int(r) for r in args.ranks.split(",")]
        except ValueError:
            raise UsageError(f"--ranks takes comma-separated integers, got {args.ranks!r}") from None
        source = "\n" + cell  # line numbers then match the cell's, whose first line is %%ranks
        try:
            pushed = names_to_push(source, self.shell.user_ns)
        except SyntaxError as e:
            raise UsageError(f"the cell is not valid Python: {e}") from None
        timeout = "cluster" if args.timeout is None else args.timeout  # "cluster": the cluster's own timeout
        cluster.run_cell(source, filename=f"Cell In[{self.shell.displayhook.prompt_count}]", pushed=pushed,
                         ranks=ranks, timeout=timeout)

    @cell_magic
    def test(self, line: str, cell: str) -> None:
        """%%test NAME: a test cell of the exercise NAME. It reaches the exercise only across the boundary (plain
        data back), runs on fresh test ranks, and fails with one line saying which case failed (testcell)."""
        names = line.split()
        if not names:
            raise UsageError("%%test needs the name of the exercise it tests, e.g. %%test ring_all_reduce")
        testcell.run_in_notebook("\n" + cell, names, self.shell.user_ns, filename=f"<test of {' '.join(names)}>",
                                 is_cell=self._is_cell, cell_name=self._cell_name)

    @line_magic
    @no_var_expand  # the request is data: IPython's $name expansion would only cost time
    def cs336_call(self, line: str) -> None:
        """%cs336_call REPLY_FILE REQUEST: a request from the grader's process (cs336_parallel.boundary), answered in
        REPLY_FILE as plain data. Not for learners: the grader sends it while it grades this notebook."""
        from .kernel_side import KernelSide

        path, _, payload = line.strip().partition(" ")
        reply = KernelSide(self.shell.user_ns, self._is_cell, self._cell_name).serve(payload)
        with open(path + ".tmp", "wb") as f:
            f.write(reply)
        os.replace(path + ".tmp", path)

    def _is_cell(self, filename: str) -> bool:
        return filename in self.shell.compile._filename_map

    def _cell_name(self, filename: str) -> str:
        return f"Cell In[{self.shell.compile._filename_map.get(filename, '?')}]"

    @line_magic
    def grade(self, line: str) -> None:
        """%grade [NOTEBOOK]: grade this notebook (or NOTEBOOK), as saved, in a fresh kernel: against the hidden
        tests in the course's repository, against the visible ones in a student edition; prints one line per test,
        with the reason of each failure. Save first (Ctrl+S)."""
        from . import selfcheck  # not at %load_ext: it reads notebooks (nbformat: a second to import)

        if os.environ.get(selfcheck.RUNNING) or os.environ.get("NBGRADER_EXECUTION"):
            print("%grade does nothing while this notebook is itself being graded or checked.")
            return
        path = line.strip() or os.environ.get("JPY_SESSION_NAME", "")  # JupyterLab names the notebook here
        if not path:
            raise UsageError("Which notebook? Run %grade notebooks/01_collectives.ipynb (this kernel was not "
                             "started by JupyterLab, so it does not know its notebook).")
        saved = time.strftime("%H:%M:%S", time.localtime(os.path.getmtime(path)))
        print(f"Grading {os.path.basename(path)} as saved at {saved} (press Ctrl+S first if you changed it since).",
              flush=True)
        command, repository = grade_command(os.path.abspath(path))
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=repository) as grader:
            for output in grader.stdout:
                print(output, end="", flush=True)
        if grader.returncode:
            raise UsageError(f"grading stopped with exit code {grader.returncode} (its output is above)")

    def _require(self) -> Cluster:
        if self.cluster_ is None:
            raise UsageError("No cluster is running: start one with `%cluster start -n 4`.")
        return self.cluster_
