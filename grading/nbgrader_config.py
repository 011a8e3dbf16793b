"""nbgrader configuration of the course. grading/course.py points CourseDirectory.root at this folder
(or at a temporary copy, for self-grading and tests)."""

c = get_config()  # noqa: F821 - nbgrader defines it

c.CourseDirectory.course_id = "cs336-parallel"

# Test cells start ranks and run them; a deadlocked exercise fails its own test after
# cs336_parallel.checks.TEST_TIMEOUT_S (30 s). This limit is the backstop for anything else.
c.Execute.timeout = 300
c.Execute.kernel_name = "cs336-parallel"  # registered by `make lab` / `make test`
# nbgrader's default argument, plus: the kernel's start-up notices stay out of the grader's console.
c.Execute.extra_arguments = ["--HistoryManager.hist_file=:memory:", "--IPKernelApp.log_level=ERROR"]

# The stub left in place of every solution.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

# Scores an answer cannot fake (grading/verdict.py): no partial credit from a displayed number, and no trust in
# tests that run after code reaching into the kernel or the grader. The feedback shows no hidden test.
import os.path as _path  # noqa: E402
import sys as _sys  # noqa: E402

_sys.path.insert(0, _path.dirname(_path.dirname(_path.abspath(__file__))))
from nbconvert.preprocessors import ClearMetadataPreprocessor, CSSHTMLHeaderPreprocessor  # noqa: E402
from nbgrader.preprocessors import (  # noqa: E402
    AssignLatePenalties,
    CheckCellMetadata,
    ClearHiddenTests,
    Execute,
    GetGrades,
    IgnorePattern,
    LimitOutput,
    SaveAutoGrades,
)

from grading.verdict import FlagTampering, NoPartialCredit  # noqa: E402

c.Autograde.autograde_preprocessors = [
    Execute, IgnorePattern, ClearMetadataPreprocessor, LimitOutput, FlagTampering, NoPartialCredit, SaveAutoGrades,
    AssignLatePenalties, CheckCellMetadata]
c.GenerateFeedback.preprocessors = [GetGrades, ClearHiddenTests, CSSHTMLHeaderPreprocessor]
