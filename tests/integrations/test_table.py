"""docs/integrations.md's table is the one tests/integrations/table.py generates from the checks."""
import pytest

pytest.importorskip("deepspeed")


def test_integrations_table_is_generated():
    from tests.integrations import table

    block = table.PAGE.read_text().split(table.BEGIN, 1)[1].split(table.END, 1)[0].strip("\n")
    assert block == table.table(), "docs/integrations.md differs: run `python -m tests.integrations.table --write`"
