"""Cases that tests/test_exit_status.py runs in a child pytest (not collected by the suite:
the file name does not match ``test_*.py``)."""


def test_passes() -> None:
    assert True


def test_fails() -> None:
    assert 1 + 1 == 3
