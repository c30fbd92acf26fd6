"""A spec that moves a constant the way an experiment already judged did is a near-duplicate:
`autolab validate` and the experiment's status say so (it still runs)."""

from __future__ import annotations

import yaml

from controller.local import init_lab
from controller.cli.main import main
from labkit import InstantBackend, run_until_done, spec_from_edit


def test_the_same_move_as_a_rejected_experiment_is_flagged_and_still_runs(tmp_path, capsys,
                                                                         monkeypatch):
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic")
    lab.repo.set_master_metric(1.0)
    lab.backends["local"] = InstantBackend(lambda req: 1.05)  # every run: worse
    lab.apply_file(spec_from_edit(lab, "lr-up", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"), "t")
    assert run_until_done(lab)["lr-up"]["outcome"] == "Rejected"

    more = spec_from_edit(lab, "lr-up-more", "MATRIX_LR = 0.02", "MATRIX_LR = 0.05")
    down = spec_from_edit(lab, "lr-down", "MATRIX_LR = 0.02", "MATRIX_LR = 0.01")
    for doc in (more, down):
        (tmp_path / f"{doc['metadata']['name']}.yaml").write_text(yaml.safe_dump(doc))
    capsys.readouterr()
    assert main(["validate", "--lab", str(lab.root), str(tmp_path / "lr-up-more.yaml"),
                 str(tmp_path / "lr-down.yaml")]) == 0
    out = capsys.readouterr().out
    more_out, down_out = out.split("lr-down.yaml")[0], out.split("lr-down.yaml")[1]
    assert "near-duplicate: lr-up (rejected, val_bpb 1.050000) also moved MATRIX_LR up" \
        in more_out
    assert "near-duplicate" not in down_out, "the other direction is a different idea"

    lab.apply_file(more, "t")
    lab.apply_file(down, "t")
    statuses = run_until_done(lab)
    flagged = {n: [c for c in st.get("conditions", []) if c["type"] == "NearDuplicate"]
               for n, st in statuses.items()}
    assert flagged["lr-up-more"] and "lr-up" in flagged["lr-up-more"][0]["message"]
    assert not flagged["lr-down"]
    assert statuses["lr-up-more"]["phase"] == "Succeeded", "a warning, not a refusal"
