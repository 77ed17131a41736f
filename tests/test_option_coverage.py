"""Every option value has a test naming it (tests/option_coverage.py's census): a new option, or a new value of a
choice, fails here until a test sets it, and a gap closed by a test must leave ``GAPS``."""

from tests.option_coverage import census

#: option values no test sets yet, as the census found them: each is to get a test of its hand-computed effect on a
#: tiny case (then leave this list); a value not here that no test sets fails the test below
GAPS: set[str] = set()


def test_every_option_value_has_a_test_naming_it_or_is_a_listed_gap():
    done, missing = census()
    new = sorted(set(missing) - GAPS)
    closed = sorted(GAPS - set(missing))
    assert not new, f"option values no test sets (write a test of each one's effect): {new}"
    assert not closed, f"gaps a test now closes: remove them from GAPS: {closed}"
    assert len(done) > 200  # the census found the options (a broken walk would find none and pass)
