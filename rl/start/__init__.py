"""Starting policies: the packaged pretrained model upcycled into a sparse MoE (pretrained.py),
tiny random models for tests (tiny.py), and the supervised warm start on the scripted experts
(warm_start.py, with its demonstrations in sft.py)."""
