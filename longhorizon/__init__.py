"""longhorizon's command-line tools, on top of everything else: `longhorizon train | submit | jobs |
inspect | replay | export | plot | eval | demo | policy | envs | sandbox` (cli.py), and what only
they use: the run summaries and episode views (inspect.py), the HTML viewer (viewer.py), PNG
curves (plot.py), Ray Jobs submission (jobs.py), replay and rescoring (replay.py), the demo
(demo.py) and the subcommands, one module each (commands/).

The layers below, bottom to top: rewards/ and policy/, envs/, rollout/, rl/ (loop, learner,
weight sync, starting policies, store). Nothing below imports this package.
"""
