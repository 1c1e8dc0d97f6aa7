"""Every mutant of tests/fuzz/mutants.py still applies: the line it edits is in its file once
(a refactor that moves the line must move the mutant with it)."""

import pytest

from tests.fuzz.mutants import MUTANTS, ROOT


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_the_mutated_line_is_in_its_file_once(name):
    file, old, new, _ = MUTANTS[name]
    text = (ROOT / file).read_text()
    assert text.count(old) == 1, f"{name}: {file} holds {text.count(old)} copies of {old!r}"
    assert new != old
