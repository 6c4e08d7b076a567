"""Situation 8: a save inside a real pytest session, with pytest's AssertionRewritingHook first.

This file is a pytest test module. tests/test_e2e_imports.py copies it into a fresh folder
(as ``test_save_under_pytest.py``) and runs pytest there, in a venv with pytest and the
wheel installed; ``IMPORT_SCRIPTS_DIR`` points back here for ``_save``. pytest puts its
assertion-rewriting finder at ``sys.meta_path[0]``, ahead of ours.
"""

import os
import sys

sys.path.insert(0, os.environ["IMPORT_SCRIPTS_DIR"])
import _save


def test_save_with_assertion_rewriting_hook_first(tmp_path):
    from _pytest.assertion.rewrite import AssertionRewritingHook

    assert isinstance(sys.meta_path[0], AssertionRewritingHook), sys.meta_path
    result = _save.save_and_load(str(tmp_path / "ckpt"))
    assert isinstance(sys.meta_path[0], AssertionRewritingHook), sys.meta_path
    assert result["ok"], result["error"]
    report = _save.write_item_report()
    assert report["marked"] and report["wraps_torch_once"] and report["levels"] == 1, report
    assert len(_save.our_finders()) == 1, sys.meta_path
