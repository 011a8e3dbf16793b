"""Running one submission: its notebook, with the course's test cells restored, executed in a sandbox under
limits. What comes back is the executed notebook, built by the grader's own executor from the kernel's
messages; nothing in the sandbox can write it. The course's test cells never reach the kernel: they run in this
process (grading/grader.py) and ask the kernel for plain data. The grader then scores it (grading/classroom.py).

Limits, per notebook (`Limits`):
- wall-clock time, from the first cell (the kernel's start, which runs nothing of the submission, has its own
  time-out, `selfcheck.KERNEL_START_TIMEOUT_S`): each cell may take what is left of it (and at most nbgrader's
  `Execute.timeout`); when it runs out, the running cell is stopped and no later cell runs;
- memory, for everything the notebook starts together (a cgroup, grading/cgroup.py): past it the kernel's
  OOM killer stops a process, and a kernel that dies runs no later cell;
- output size, of everything the cells show together: past it the kernel is stopped.
A cell that does not finish gets an error that says which limit stopped it (`LimitExceeded`): a test cell
scores 0 with that reason, and the cells before keep their points.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import nbformat
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbformat.notebooknode import NotebookNode
from nbgrader.converters import Autograde
from nbgrader.preprocessors import Execute
from nbgrader.preprocessors.execute import UnresponsiveKernelError
from traitlets import Enum
from traitlets.config import Config

from cs336_parallel.text import red_headline
from grading import cgroup, sandbox, verdict
from grading.cgroup import MemoryLimit
from grading.gradebook import Submission
from grading.grader import KernelStopped, TestSession
from grading.rank_box import RankBox

RESULTS = "executed"  # <course>/executed/<assignment>/<student>/{<assignment>.ipynb, run.json, scored}
# The assignments whose ranks (the notebook's and its tests') step no optimizer: their two rank servers are told so
# (cs336_parallel.rank_server.NO_OPTIMIZER), and leave out what only an optimizer's first step imports (1 CPU-s each).
NO_OPTIMIZER_ON_RANKS = frozenset({"00_setup", "01_collectives"})


@dataclass
class Limits:
    wall_s: float = 900.0  # the whole notebook (one runs in about 2 minutes on 2 cores, alone)
    memory_mb: int = 4096  # the kernel and its ranks together
    output_mb: float = 5.0  # what all cells show together (text, images, errors)


@dataclass
class Execution:
    """What running a submission returned, besides the executed notebook (saved as run.json beside it)."""
    assignment: str
    student: str
    key: str
    seconds: float = 0.0
    limit: str = ""  # the limit that stopped the notebook early, in one line ("" if none did)
    error: str = ""  # why it could not be run at all (then there is no executed notebook)
    sandbox: str = "bubblewrap"  # or "none" (--no-sandbox)
    memory_limit: bool = True  # False where no cgroup could enforce it


def result_dir(results: Path, assignment: str, student: str) -> Path:
    return results / assignment / student


def load_execution(results: Path, assignment: str, student: str) -> Execution | None:
    try:
        return Execution(**json.loads((result_dir(results, assignment, student) / "run.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def rank_settings(master: Path | None) -> dict[str, str]:
    """What the notebook's rank servers (the kernel's and the test ranks') are told about its ranks."""
    return {"CS336_RANKS_STEP_NO_OPTIMIZER": "1"} if master is not None and master.stem in NO_OPTIMIZER_ON_RANKS \
        else {}


def limit_error(reason: str) -> NotebookNode:
    return NotebookNode(output_type="error", ename="LimitExceeded", evalue=reason,
                        traceback=[red_headline("LimitExceeded", reason)])


class LimitedExecute(Execute):
    """nbgrader's Execute, with the kernel in a sandbox and the notebook under `Limits`; the course's test cells run
    in this process (grading/grader.py), reaching the kernel only through `run_request`."""

    # Nothing in the sandbox needs a clean exit: killing it at once frees its slot seconds sooner.
    shutdown_kernel = Enum(["graceful", "immediate"], default_value="immediate")

    def __init__(self, *, box: Path, limits: Limits, use_sandbox: bool, memory: MemoryLimit | None,
                 interrupt: threading.Event, master: Path | None = None, user: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.box, self.limits, self.use_sandbox, self.memory, self.user = box, limits, use_sandbox, memory, user
        self.interrupt = interrupt  # set by the grader's Ctrl-C: stop now, and keep nothing of this run
        self.cell_timeout = self.timeout  # nbgrader's backstop per cell (nbgrader_config.py)
        self.stopped = ""  # why no further cell runs
        self.shown_bytes = 0  # bytes of output so far
        self.ranks = RankBox(box, use_sandbox=use_sandbox, user=user, memory=memory, settings=rank_settings(master))
        self.reply_path = box / "k" / "reply"  # where the kernel answers a test's request
        self.tests = TestSession(master, self) if master else None  # the course's tests, run here
        self.index = 0  # the cell being run

    def create_kernel_manager(self):
        self.km = sandbox.SandboxedKernelManager(
            kernel_name=self.kernel_name or self.nb.metadata.get("kernelspec", {}).get("name", "python3"),
            config=self.config, box=str(self.box), sandbox=self.use_sandbox, user=self.user or "",
            cgroup_procs=str(self.memory.procs) if self.memory else "", settings=self.ranks.settings,
            max_message_bytes=max(64 << 20, 2 * int(self.limits.output_mb * 1e6)))
        return self.km

    def preprocess(self, nb, resources=None, km=None):
        self.deadline = math.inf  # from the first cell on: however long the kernel took to start on a busy machine
        return super().preprocess(nb, resources, km)

    def preprocess_cell(self, cell, resources, index):
        if self.deadline == math.inf:
            self.deadline = time.monotonic() + self.limits.wall_s
        if cell.cell_type != "code" or not cell.source.strip():
            return cell, resources
        self.index = index
        if self.interrupt.is_set():
            self.stop("grading was interrupted")
        if not self.stopped and time.monotonic() >= self.deadline:
            self.stop(self.wall_clock_reason())
        is_test = self.tests is not None and self.tests.is_test(cell)
        if self.stopped:
            cell.outputs = [limit_error(f"not run: {self.stopped}")]
            if is_test:
                verdict.record(cell, f"not run: {self.stopped}")
            return cell, resources
        if is_test:
            cell.outputs, cell.execution_count = self.tests.run_test(cell), None
            reason = next((o.evalue for o in cell.outputs if o.output_type == "error"), None)
            if self.stopped:  # the kernel stopped during the test: the limit says more than the test could
                cell.outputs = [o for o in cell.outputs if o.output_type != "error"] + [limit_error(self.stopped)]
                reason = self.stopped
            verdict.record(cell, reason)
            return cell, resources
        left = self.deadline - time.monotonic()
        self.timeout = max(1, math.ceil(min(self.cell_timeout or left, left)))
        try:
            cell, resources = super().preprocess_cell(cell, resources, index)
        except (DeadKernelError, CellTimeoutError) as e:
            self.stop(self.wall_clock_reason() if time.monotonic() >= self.deadline else self.death_reason(e))
            cell.outputs = [o for o in cell.outputs if o.output_type != "error"] + [limit_error(self.stopped)]
            return cell, resources
        if not self.stopped and time.monotonic() >= self.deadline and any(
                o.get("ename") == "CellTimeoutError" for o in cell.outputs):
            self.stop(self.wall_clock_reason())
        if self.stopped:  # a limit stopped this cell: its own error (timeout, interrupt) says less than ours
            cell.outputs = [o for o in cell.outputs if o.output_type != "error"] + [limit_error(self.stopped)]
        return cell, resources

    def run_request(self, code: str, timeout: float) -> list[NotebookNode]:
        """Run `code` in the kernel outside the notebook (a test's request, `%cs336_call`), within `timeout` and
        what is left of the wall-clock limit; its outputs. Raises KernelStopped when the kernel stops answering
        (then no later cell runs)."""
        if self.interrupt.is_set():
            self.stop("grading was interrupted")
        left = self.deadline - time.monotonic()
        if not self.stopped and left <= 0:
            self.stop(self.wall_clock_reason())
        if self.stopped:
            raise KernelStopped(self.stopped)
        request, test_cell = nbformat.v4.new_code_cell(code), self.nb.cells[self.index]
        self.timeout = max(1, math.ceil(min(timeout, left)))
        try:
            request = self.execute_cell(request, self.index, store_history=False)
        except (DeadKernelError, CellTimeoutError) as e:
            self.stop(self.wall_clock_reason() if time.monotonic() >= self.deadline else self.death_reason(e))
        finally:
            self.nb.cells[self.index] = test_cell  # nbclient puts the cell it ran in the notebook
        if not self.stopped and time.monotonic() >= self.deadline:
            self.stop(self.wall_clock_reason())
        if self.stopped:
            raise KernelStopped(self.stopped)
        if any(o.get("ename") == "CellTimeoutError" for o in request.outputs):  # interrupted: the kernel goes on
            return [nbformat.v4.new_output("error", ename="Timeout", evalue=f"no reply within {self.timeout} s",
                                           traceback=[])]
        return request.outputs

    def allowance(self) -> int:
        """Bytes a reply may still take: what is left of the output limit."""
        return max(0, int(self.limits.output_mb * 1e6) - self.shown_bytes)

    def charge(self, nbytes: int) -> None:
        """A reply counts against the output limit, as what the cells show does."""
        self.shown_bytes += nbytes

    def process_message(self, msg, cell, cell_index):
        if msg["msg_type"] in ("stream", "display_data", "execute_result", "error", "update_display_data"):
            self.shown_bytes += len(json.dumps(msg["content"]))
            if self.stopped:
                return None
            if self.shown_bytes > self.limits.output_mb * 1e6:
                self.stop(f"the notebook's output passed its limit of {self.limits.output_mb:g} MB, and it was "
                          "stopped")
                return None
        return super().process_message(msg, cell, cell_index)

    def wall_clock_reason(self) -> str:
        return f"the notebook used its wall-clock limit of {self.limits.wall_s:g} s, and it was stopped"

    def death_reason(self, error: Exception) -> str:
        if isinstance(error, CellTimeoutError):
            return "the kernel stopped answering (no output came back), and it was stopped"
        if self.memory is not None and self.memory.hit():
            return f"the notebook used more than its memory limit of {self.limits.memory_mb} MB, and it was stopped"
        return "the kernel died (its process ended)"

    def stop(self, reason: str) -> None:
        """No further cell runs; the kernel and everything it started are killed now (from any thread)."""
        self.stopped = self.stopped or reason
        self.ranks.close()
        provisioner = getattr(self.km, "provisioner", None)
        pgid = getattr(provisioner, "pgid", None)
        if pgid:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass


def sanitized(job: Submission, config: Config, db_url: str) -> tuple[NotebookNode, dict]:
    """The submitted notebook as nbgrader's autograde makes it before executing it: outputs cleared, the
    course's test and read-only cells restored from the gradebook (at `db_url`)."""
    nb = nbformat.read(job.folder / f"{job.assignment}.ipynb", as_version=4)
    resources = {"nbgrader": {"notebook": job.assignment, "assignment": job.assignment, "student": job.student,
                              "db_url": db_url}}
    configured = config.Autograde.get("sanitize_preprocessors")
    for preprocessor in configured or Autograde.class_traits()["sanitize_preprocessors"].default():
        nb, resources = preprocessor(config=config)(nb, resources)
    for cell in nb.cells:  # a verdict comes from this run only, never from the submitted file
        cell.metadata.pop(verdict.KEY, None)
    return nb, resources


_running: set[LimitedExecute] = set()
_running_lock = threading.Lock()


def interrupt_all() -> None:
    """Stop every notebook running in this process now (the grader's Ctrl-C)."""
    with _running_lock:
        for executor in _running:
            executor.stop("grading was interrupted")


def execute_notebook(nb: NotebookNode, resources: dict, box: Path, config: Config, limits: Limits,
                     master: Path | None = None,
            use_sandbox: bool = True, interrupt: threading.Event | None = None,
            user: str | None = None) -> tuple[NotebookNode, str]:
    """Execute `nb` with its kernel working in box/work, under `limits`, the test cells of `master` (the course's
    notebook) in this process: the executed notebook, and the limit that stopped it early ("" if none did). Without
    a sandbox, the kernel and the test ranks run as `user` (if given), and every process of that user is ended
    afterwards. Raises RuntimeError if the kernel does not start."""
    user = None if use_sandbox else user
    interrupt = interrupt or threading.Event()
    with sandbox.only_grader_as(user, interrupt) if user else contextlib.nullcontext():
        return _execute(nb, resources, box, config, limits, master, use_sandbox, interrupt, user)


def _execute(nb: NotebookNode, resources: dict, box: Path, config: Config, limits: Limits, master: Path | None,
             use_sandbox: bool, interrupt: threading.Event, user: str | None) -> tuple[NotebookNode, str]:
    memory = MemoryLimit.create(limits.memory_mb << 20) if limits.memory_mb else None
    executor = LimitedExecute(config=config, box=box, limits=limits, use_sandbox=use_sandbox, memory=memory,
                              interrupt=interrupt, master=master, user=user)
    with _running_lock:
        _running.add(executor)
    try:
        nb, _ = executor.preprocess(nb, {**resources, "metadata": {"path": str(box / "work")}})
        if not executor.stopped and memory is not None and memory.hit():
            return nb, f"a process of the notebook passed its memory limit of {limits.memory_mb} MB and was stopped"
        return nb, executor.stopped
    except UnresponsiveKernelError:  # the kernel did not start: the grader's problem, not the student's
        log = (box / "k" / "kernel.log").read_text(errors="replace")[-1000:] if (box / "k").exists() else ""
        raise RuntimeError(f"the kernel did not start: {log.strip() or 'no message'}") from None
    finally:
        with _running_lock:
            _running.discard(executor)
        executor.ranks.close()
        if memory is not None:
            memory.close()
        if executor.user:
            sandbox.end_processes_of(executor.user)


def execute_submission(job: Submission, results: Path, config: Config, db_url: str, limits: Limits,
                       use_sandbox: bool = True,
        interrupt: threading.Event | None = None, user: str | None = None) -> Execution | None:
    """Execute one submission in a private folder and save the executed notebook under `results`. Returns
    None, and saves nothing, if `interrupt` is set before it finishes."""
    interrupt = interrupt or threading.Event()
    if interrupt.is_set():
        return None
    started = time.monotonic()
    record = Execution(job.assignment, job.student, job.key(),
                 sandbox="bubblewrap" if use_sandbox else f"user {user}" if user else "none",
                 memory_limit=bool(limits.memory_mb) and cgroup.unavailable() is None)
    box = Path(sandbox.private_folder())
    nb = None
    try:
        shutil.copytree(job.folder, box / "work")
        nb, resources = sanitized(job, config, db_url)
        nb, record.limit = execute_notebook(nb, resources, box, config, limits, job.master, use_sandbox, interrupt,
                                            user)
    except Exception as e:  # noqa: BLE001 - one submission's problem must not stop the class
        record.error = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(box, ignore_errors=True)
    if interrupt.is_set():
        return None
    record.seconds = round(time.monotonic() - started, 1)
    save(results, record, None if record.error else nb)
    return record


def save(results: Path, record: Execution, nb: NotebookNode | None) -> None:
    """Write the executed notebook, then run.json (its presence marks a finished run), each atomically."""
    folder = result_dir(results, record.assignment, record.student)
    folder.mkdir(parents=True, exist_ok=True)
    if nb is not None:
        _write_atomic(folder / f"{record.assignment}.ipynb", nbformat.writes(nb))
    _write_atomic(folder / "run.json", json.dumps(asdict(record), indent=1))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
