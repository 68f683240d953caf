"""The staleness explorer: weight stashing and vertical sync change the readout; runs are cached."""

from __future__ import annotations

import re

from gpipe_ref.widgets.staleness import StalenessExplorer


def test_staleness_explorer_readout_follows_the_controls(monkeypatch):
    import gpipe_ref.staleness as staleness

    trained = []
    convergence = staleness.convergence
    monkeypatch.setattr(staleness, "convergence", lambda variant, **kw: trained.append(variant) or convergence(variant, **kw))
    ex = StalenessExplorer(stages=2, microbatches=4, lr=0.2, steps=4)
    text = re.sub(r"<[^>]+>", "", ex.readout.value)
    assert "weight stashing on" in text and "versions held per stage [2, 1]" in text
    assert "largest forward/backward version mismatch 0" in text
    ex.weight_stashing.value = False
    text = re.sub(r"<[^>]+>", "", ex.readout.value)
    assert "weight stashing off" in text and "versions held per stage [1, 1]" in text
    assert "largest forward/backward version mismatch 0" not in text
    ex.vertical_sync.value = True
    assert "vertical sync on" in re.sub(r"<[^>]+>", "", ex.readout.value)
    ex.microbatches.value = 6
    assert ex.heat.value.count("<td") == 2 * 6 and "<svg" in ex.picture.value and "<polyline" in ex.curves.value
    assert trained == ["pipedream_stash", "gpipe", "pipedream_no_stash", "pipedream_vertical_sync"]
    ex.weight_stashing.value = True  # cached: redraws without training again
    ex.vertical_sync.value = False
    assert len(trained) == 4 and "weight stashing on" in re.sub(r"<[^>]+>", "", ex.readout.value)


def test_the_drawn_versions_are_the_ones_the_trainer_used():
    ex = StalenessExplorer(stages=4, microbatches=5, lr=0.2, steps=2)
    for stash, vsync in ((True, False), (False, False), (True, True)):
        ex.weight_stashing.value, ex.vertical_sync.value = stash, vsync
        drawn = {(e.stage, e.microbatch, e.op): e.weight_version for e in ex.timeline.events}
        used = {(e.stage, e.microbatch, e.op): e.weight_version for e in ex.record.timeline.events}
        assert drawn == used
        assert {(s, i): (drawn[(s, i, "F")], drawn[(s, i, "B")]) for s, i in ex.record.versions} == \
               {key: (f, b) for key, (f, b, _) in ex.record.versions.items()}
