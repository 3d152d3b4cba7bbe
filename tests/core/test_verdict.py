"""The verdict names files the same whatever py-spy's shortening left in front of them (it shortens by the
target's sys.path, and an install can leave site-packages/ in the short name)."""

from verl_exporter.core.verdict import verdict


def process(rank, short):
    frames = [{"name": "all_reduce", "short_filename": short, "filename": "/x/" + short},
              {"name": "rank_main", "short_filename": "hang_gloo.py", "filename": "/t/hang_gloo.py"}]
    return {"rank": rank, "threads": [{"thread_name": "MainThread", "frames": frames}]}


def test_site_packages_in_a_short_filename_does_not_split_the_ranks():
    text = verdict([process(0, "site-packages/torch/distributed/distributed_c10d.py"),
                    process(1, "torch/distributed/distributed_c10d.py")])
    assert text.startswith("all ranks 0-1 wait in all_reduce (torch/distributed/distributed_c10d.py), called from "
                           "rank_main (hang_gloo.py)"), text
