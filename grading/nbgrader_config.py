"""nbgrader configuration of the course. grading/gradebook.py loads it, whatever the course folder (CourseDirectory.root
is set there), and refuses to grade if it does not load or does not configure the course's grader: grading never
falls back to nbgrader's defaults."""

import sys

c = get_config()  # noqa: F821 - nbgrader defines it

c.CourseDirectory.course_id = "cs336-parallel"

# The stub left in place of every solution.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

try:
    from nbconvert.preprocessors import ClearMetadataPreprocessor, CSSHTMLHeaderPreprocessor
    from nbconvert.preprocessors.sanitize import SanitizeHTML
    from nbgrader.preprocessors import (
        AssignLatePenalties,
        CheckCellMetadata,
        ClearHiddenTests,
        GetGrades,
        IgnorePattern,
        LimitOutput,
    )

    from cs336_parallel import selfcheck
    from grading.verdict import KEY, ExecutedNotebook, SaveVerdicts
except ImportError as e:  # SystemExit, not an exception: nbgrader would log an exception and grade with defaults
    sys.exit(f"cs336-parallel: the course's grading code could not be imported ({e}); nothing is graded. Grade "
             "from the repository root with `python -m grading autograde` (grading/README.md).")

# The notebook's cells run in a sandboxed kernel (grading/runner.py); its test cells run in the grader's own
# process (grading/grader.py). A deadlocked exercise fails its own test after cs336_parallel.checks.hang_timeout_s()
# (30 s); this limit per cell is the backstop for anything else. The kernel and its quiet start as the learner's
# self-check has them.
c.Execute.timeout = selfcheck.CELL_TIMEOUT_S
c.Execute.startup_timeout = selfcheck.KERNEL_START_TIMEOUT_S
c.Execute.kernel_name = selfcheck.KERNEL  # registered by `make lab` / `make test`
c.Execute.extra_arguments = selfcheck.QUIET_KERNEL  # nbgrader's default argument; no start-up notices

# Scoring. The course's grader (`python -m grading autograde`) executes each notebook itself, the tests in its own
# process, and records a verdict on each test cell; nbgrader's autograde then takes that executed notebook
# (ExecutedNotebook, which refuses to run without one: nbgrader's own `autograde` would run the tests in the
# student's kernel) and scores each test cell by its verdict (SaveVerdicts).
c.Autograde.autograde_preprocessors = [
    ExecutedNotebook, IgnorePattern, ClearMetadataPreprocessor, LimitOutput, SaveVerdicts, AssignLatePenalties,
    CheckCellMetadata]
c.ClearMetadataPreprocessor.preserve_cell_metadata_mask = [("nbgrader",), (KEY,)]
# The feedback shows no hidden test, and what a submission displayed as HTML or JavaScript only as sanitized text.
c.GenerateFeedback.preprocessors = [GetGrades, ClearHiddenTests, SanitizeHTML, CSSHTMLHeaderPreprocessor]
c.SanitizeHTML.enabled = True  # nbconvert's preprocessors are off until enabled
