"""The project's sparse-MoE policy in plain PyTorch (KDA + gated MLA, attention residuals, LatentMoE
with quantile balancing, SiTU-GLU, vision), its checkpoints and its parallelisation (applied from
outside the model files). See policy/README.md. Starting policies (tiny random models, the
packaged pretrained one) are made in rl/, where runs are set up."""
