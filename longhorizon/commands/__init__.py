"""The subcommands of `longhorizon`, one module each, each with its own `add_parser(sub)`; the
handlers import what they need when they run, so `longhorizon --help` stays quick."""

from longhorizon.commands import (
    cluster,
    demo,
    envs,
    evaluate,
    export,
    inspect,
    plot,
    policy,
    replay,
    serve,
    train,
)

# in `longhorizon --help` order
COMMANDS = (train, cluster, inspect, replay, export, plot, evaluate, demo, policy, envs, serve)
