"""The inventory of every input the product reads, and the fuzz or property tests that hold each one.

tests/test_boundary_inventory.py walks the package's code for reads (open, read_text, json and YAML loads,
directory listings, os.environ, a WSGI request's environ, urlopen answers, argv...) and fails when a function
that reads is not named here, when a function named here is gone, or when a named test does not exist.

To add an input: one more Boundary(...) in INVENTORY (or one more reader in the entry it belongs to):

    Boundary("what is read, in words", "file",                     # one of KINDS
             readers=("sidecar/ib.py::read_counters",),             # module under exporter/verl_exporter/ :: function
             tests=("tests/test_ib.py::test_any_counter_file_costs_only_itself",)),   # its fuzz / property test

A reader is "module.py::function", "module.py::Class.method" or "module.py::outer.inner" (a nested function).
NOT_INPUTS names the functions the walk finds that read nothing from outside, each with why.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "exporter" / "verl_exporter"
KINDS = ("file", "http", "answer", "argv", "env", "api")


@dataclass(frozen=True)
class Boundary:
    input: str  # what is read, in words
    kind: str  # one of KINDS
    readers: tuple[str, ...]  # the functions that read it: "module.py::Class.function"
    tests: tuple[str, ...]  # the fuzz or property tests that hold it: "tests/test_x.py::test_name"


FUZZ = "tests/test_inputs_fuzz.py::"

INVENTORY: tuple[Boundary, ...] = (
    # ------------------------------------------------------------------ files
    Boundary("verl's JSONL log, followed (file logger)", "file",
             ("sidecar/sources/verl_file.py::VerlFileFollower._open",
              "sidecar/sources/verl_file.py::VerlFileFollower._read_available",
              "sidecar/sources/verl_file.py::VerlFileFollower._reset",
              "sidecar/sources/verl_file.py::VerlFileFollower._same_head",
              "sidecar/sources/verl_file.py::VerlFileFollower._same_mark",
              "sidecar/sources/verl_file.py::VerlFileFollower._tail_start",
              "sidecar/sources/verl_file.py::VerlFileFollower._count_nonfinite_before",
              "sidecar/sources/verl_file.py::parse_line"),
             ("tests/test_follower_fuzz.py::test_the_follower_survives_any_stream_of_bytes_and_file_events",
              "tests/test_follower_fuzz.py::test_arbitrary_lines_never_crash_the_follower_and_cost_only_themselves")),
    Boundary("a console log or notebook (convert, backtest, calibrate)", "file",
             ("sidecar/sources/console.py::read_text", "sidecar/sources/console.py::notebook_output",
              "sidecar/sources/console.py::convert"),
             (FUZZ + "test_any_console_text_gives_records_or_a_clear_error",)),
    Boundary("a recorded run for backtest / calibrate (verl JSONL, else console)", "file",
             ("tools/replay.py::read_run",),
             (FUZZ + "test_any_run_file_is_read_or_refused_clearly",)),
    Boundary("the progress state (--state-dir progress.json), the sidecar's own", "file",
             ("sidecar/progress.py::Progress._load",),
             ("tests/test_progress.py::test_any_json_object_as_the_state_file_starts_the_sidecar",
              "tests/test_progress.py::test_any_byte_mutation_of_a_state_file_starts_the_sidecar")),
    Boundary("a JSON file the pack wrote itself, through the one hostile reader (state, spool, captures)", "file",
             ("core/models.py::read_json",),
             ("tests/test_progress.py::test_any_byte_mutation_of_a_state_file_starts_the_sidecar",
              FUZZ + "test_any_spool_file_is_requeued_or_set_aside",
              "tests/test_forensics.py::test_any_capture_documents_give_a_verdict_without_raising")),
    Boundary("the relay's spool files (spool_dir), its own", "file",
             ("relay/dispatch.py::Dispatcher.load_spool",),
             (FUZZ + "test_any_spool_file_is_requeued_or_set_aside",)),
    Boundary("the relay's journal and spool lock, its own", "file",
             ("relay/journal.py::Journal.recover", "relay/journal.py::SpoolLock.acquire",
              "relay/journal.py::spool_holder", "relay/journal.py::_pid_in"),
             (FUZZ + "test_any_journal_is_recovered_line_by_line",
              "tests/test_relay_spool_lock.py::test_the_lock_refuses_a_second_holder_in_one_process_and_is_free_after_release")),
    Boundary("the control file (sidecar writes, trainer reads)", "file",
             ("sidecar/control.py::read_control_file", "sidecar/control.py::ControlState.request",
              "sidecar/control.py::ControlState.read", "sidecar/control.py::ControlReader.poll",
              "sidecar/control.py::ControlReader.__init__"),
             (FUZZ + "test_any_control_file_is_read_or_refused_and_never_stops_the_trainer_or_the_sidecar",
              "tests/test_control.py::test_a_fifo_as_the_control_file_never_blocks_the_trainer")),
    Boundary("the control token file (--control-token-file)", "file",
             ("sidecar/control.py::read_token",),
             (FUZZ + "test_any_token_file_is_a_token_or_an_error_that_does_not_quote_it",
              "tests/test_cli_errors.py::test_a_non_utf8_token_file_is_named_without_quoting_the_secret")),
    Boundary("verl's checkpoint tracker (latest_checkpointed_iteration.txt)", "file",
             ("checkpoint/manifest.py::read_tracker",),
             (FUZZ + "test_any_tracker_or_manifest_is_a_step_a_problem_or_nothing",
              "tests/test_checkpoint_odd_trees.py::test_a_fifo_as_the_tracker_file_does_not_block")),
    Boundary("checkpoint manifests (the callback's, read back by verify and the collector)", "file",
             ("checkpoint/manifest.py::_load_manifest", "checkpoint/cli.py::_manifest"),
             (FUZZ + "test_any_tracker_or_manifest_is_a_step_a_problem_or_nothing",
              "tests/test_checkpoint_odd_trees.py::test_a_deeply_nested_manifest_is_a_bad_manifest_not_a_traceback")),
    Boundary("a checkpoint directory's tree (global_step_N names, files hashed, activity)", "file",
             ("checkpoint/manifest.py::find_checkpoints", "checkpoint/manifest.py::walk",
              "checkpoint/manifest.py::sha256_file", "sidecar/collectors/checkpoint.py::_last_activity"),
             (FUZZ + "test_any_names_in_a_checkpoint_directory_give_its_steps_in_order",
              "tests/test_checkpoint_odd_trees.py::test_dangling_and_looping_symlinks_are_skipped_and_counted")),
    Boundary("the stack captures' folder (--forensics-dir, maybe shared with other hosts)", "file",
             ("sidecar/forensics.py::Forensics._prune",),
             (FUZZ + "test_any_folder_keeps_what_is_not_ours_and_the_answered_capture",)),
    Boundary("stack capture files, read by `verl-exporter forensics`", "file",
             ("core/verdict.py::read_captures",),
             ("tests/test_forensics.py::test_any_capture_documents_give_a_verdict_without_raising",
              "tests/test_forensics.py::test_a_deeply_nested_or_broken_capture_is_one_line_and_the_verdict_is_still_given")),
    Boundary("py-spy's JSON output", "answer",
             ("sidecar/forensics.py::Forensics.dump", "sidecar/forensics.py::parse_dump"),
             (FUZZ + "test_the_verdict_names_something_for_any_py_spy_output",)),
    Boundary("NCCL / gloo Flight Recorder dumps (--forensics-flight-recorder)", "file",
             ("core/verdict.py::read_flight_recorder", "core/verdict.py::flight_recorder_verdict"),
             (FUZZ + "test_any_flight_recorder_dump_gives_a_verdict_or_none",)),
    Boundary("/proc host files (stat, loadavg, meminfo, diskstats, net/dev, pressure/*)", "file",
             ("sidecar/collectors/cpu.py::CpuCollector._read_cpu_line",
              "sidecar/collectors/disk.py::DiskCollector._read",
              "sidecar/collectors/host.py::HostCollector._load", "sidecar/collectors/host.py::HostCollector._memory",
              "sidecar/collectors/network.py::NetworkCollector.sample",
              "sidecar/collectors/pressure.py::PressureCollector.__init__",
              "sidecar/collectors/pressure.py::PressureCollector.sample"),
             (FUZZ + "test_any_proc_file_costs_at_most_its_own_collector",)),
    Boundary("other processes: /proc/<pid>/stat, cmdline, environ (RANK) of the trainer's tree", "file",
             ("sidecar/collectors/gpu_processes.py::start_time",
              "sidecar/collectors/gpu_processes.py::RoleCache._decide",
              "sidecar/forensics.py::_rank_of", "sidecar/forensics.py::_describe"),
             ("tests/test_forensics.py::test_the_nodes_ray_workers_are_found_by_command_line",)),
    Boundary("YAML files: serve --config, relay config, --overrides, --spec, engines' prometheus.yml", "file",
             ("core/models.py::read_yaml", "sidecar/config.py::read_config_file", "relay/config.py::load_config",
              "spec/overrides.py::load_overrides", "spec/__init__.py::_read", "sidecar/engines_sd.py::EnginesSd.update",
              "sidecar/engines_sd.py::engine_file_sd"),
             ("tests/test_yaml_fuzz.py::test_arbitrary_text", "tests/test_yaml_fuzz.py::test_documents_of_any_shape",
              "tests/test_yaml_fuzz.py::test_alias_bombs_of_any_size_are_refused",
              "tests/test_engines_sd.py::test_any_document_gives_an_entry_of_valid_targets_only",
              "tests/test_engines_sd.py::test_any_mutation_of_verls_file_is_read_without_raising",
              "tests/test_engines_scrape.py::test_engines_from_counts_bad_input_keeps_the_last_entry_and_follows_changes")),
    Boundary("files a relay config names (message templates, token files)", "file",
             ("relay/config.py::_read",),
             ("tests/test_yaml_fuzz.py::test_documents_of_any_shape",)),
    Boundary("an Alertmanager webhook body from a file or stdin (relay --preview)", "file",
             ("relay/preview.py::read_payload",),
             ("tests/test_relay_fuzz.py::test_the_parser_raises_only_its_own_clear_error",)),
    # ------------------------------------------------------------------ HTTP
    Boundary("any HTTP request: request line, headers, framing (the sidecar's and the relay's server)", "http",
             ("core/httpserver.py::_Handler.handle", "core/httpserver.py::_DeadlineReader.readinto",
              "core/httpserver.py::_BoundedServer.__init__.gated", "core/httpserver.py::_ServerHandler.write",
              "core/httpserver.py::_ServerHandler.log_exception"),
             ("tests/test_boundary_fuzz.py::test_any_http_request_gets_an_answer_and_metrics_keep_serving",)),
    Boundary("sidecar GET /metrics, /healthz, /healthz/sidecar, / (method, path, Accept)", "http",
             ("exposition/app.py::make_app.app", "exposition/app.py::metrics_app.app",
              "exposition/app.py::health_handler.handle", "exposition/app.py::method_not_allowed"),
             ("tests/test_boundary_fuzz.py::test_any_http_request_gets_an_answer_and_metrics_keep_serving",)),
    Boundary("sidecar POST /control/<action> (token, Content-Length, JSON body)", "http",
             ("sidecar/control.py::make_control_app.handle",),
             (FUZZ + "test_the_control_endpoint_answers_any_request_with_json_and_a_known_status",)),
    Boundary("relay POST /alert/<receiver>: Alertmanager's webhook (token, body)", "http",
             ("relay/app.py::RelayApp.__call__", "relay/app.py::RelayApp._authorized", "relay/app.py::RelayApp._handle",
              "relay/app.py::_discard", "relay/payload.py::parse_payload"),
             ("tests/test_relay_fuzz.py::test_the_parser_raises_only_its_own_clear_error",
              "tests/test_relay_fuzz.py::test_the_webhook_answers_every_body_and_counts_every_rejection",
              "tests/test_relay_fuzz.py::test_arbitrary_webhooks_never_500_and_every_accepted_alert_arrives_once")),
    # ------------------------------------------------------------------ answers
    Boundary("robots' answers (DingTalk, WeCom, Lark, Feishu, Slack webhooks)", "answer",
             ("relay/senders.py::RobotSender.send", "relay/senders.py::RobotSender._classify"),
             ("tests/test_relay_robot_answers.py::test_any_answer_classifies_without_raising_with_a_bounded_label_and_no_secret",
              "tests/test_relay_actions.py::test_the_robot_sender_does_not_follow_a_redirect")),
    Boundary("a sidecar's answer to the relay's control action (checkpoint, stop, forensics)", "answer",
             ("relay/actions.py::ActionRunner._call", "relay/actions.py::evidence_alert"),
             ("tests/test_relay_actions.py::test_any_sidecar_answer_is_done_failed_or_refused",
              "tests/test_relay_actions.py::test_an_answer_without_applied_is_a_failure")),
    # ------------------------------------------------------------------ argv, environment, API
    Boundary("command-line arguments of every command", "argv",
             ("cli.py::main", "relay/cli.py::main"),
             (FUZZ + "test_any_serve_flags_give_a_config_or_a_usage_error",
              "tests/test_flag_table.py::test_the_flags_parse_into_the_config")),
    Boundary("RANK, LOCAL_RANK, NODE_RANK", "env",
             ("sidecar/config.py::env_int", "sidecar/node.py::rank_offset"),
             (FUZZ + "test_any_rank_variables_give_a_config", FUZZ + "test_any_node_rank_gives_an_offset")),
    Boundary("the environment handed to collectors (CUDA_VISIBLE_DEVICES, ...)", "env",
             ("sidecar/sidecar.py::Sidecar.context", "sidecar/collectors/nvml.py::_warn_if_order_ambiguous",
              "sidecar/collectors/nvml.py::select_gpus", "sidecar/collectors/nvml.py::parse_cuda_visible"),
             ("tests/test_inputs_fuzz.py::test_any_cuda_visible_devices_is_only_a_warning",)),
    Boundary("variables a relay config names (token_env, secret_env), NO_COLOR", "env",
             ("relay/config.py::_context", "relay/config.py::parse_config", "relay/cli.py::_preview",
              "relay/senders.py::ConsoleSender._color"),
             ("tests/test_yaml_fuzz.py::test_documents_of_any_shape",)),
    Boundary("VERL_EXPORTER_OVERRIDES and VERL_EXPORTER_CONTROL_FILE (paths)", "env",
             ("spec/overrides.py::resolve_path", "trainer/verl_callback.py::ControlledCheckpointCallback.__init__"),
             ("tests/test_yaml_fuzz.py::test_arbitrary_text",)),
    Boundary("Monitor.log(): the trainer's keys and values (Python API)", "api",
             ("trainer/monitor.py::Monitor.log",),
             ("tests/test_boundary_fuzz.py::test_monitor_log_takes_any_keys_and_values_and_keeps_the_good_ones",
              "tests/test_boundary_fuzz.py::test_monitor_writing_the_sidecar_file_keeps_the_good_keys_of_any_call")),
)

NOT_INPUTS: dict[str, str] = {
    "core/atomicfile.py::fsync_dir": "opens a folder only to fsync it",
    "core/atomicfile.py::remove_stale_temps": "lists its own temporary files by an exact prefix to remove them",
    "relay/senders.py::lark_signed": "parses the message body this relay has just rendered",
    "relay/senders.py::ConsoleSender.text": "parses the message body this relay has just rendered",
    "render/__init__.py::generate": "`generate --check`: compares the checkout's generated files with the spec's",
    "tools/replay.py::evaluate": "the rules this package has just generated into a temporary folder",
    "tools/demo.py::<module>": "the demo's own trainer process, started by the demo with its own argv",
    "tools/demo.py::_nonfinite_steps": "the demo's packaged run",
    "tools/demo.py::run_demo": "the demo's packaged run",
    "tools/demo.py::hang_trainer": "the demo's packaged run, on the trainer's stdin from the demo",
    "tools/demo_stack.py::FullDemo.__init__": "the demo's own environment for the programs it starts",
    "tools/demo_stack.py::FullDemo._start_trainer": "the demo's own environment for the programs it starts",
    "tools/demo_stack.py::FullDemo._alerts_seen": "the demo's own Alertmanager on loopback",
    "tools/demo_stack.py::FullDemo._generate_pack": "the files the demo has just generated",
    "tools/demo_stack.py::FullDemo._load_run": "the demo's packaged run",
    "tools/demo_stack.py::FullDemo.replay_hang": "the demo's packaged run",
    "tools/demo_stack.py::Program.tail": "the log of a program the demo started, shown when it dies",
    "tools/demo_stack.py::Program.wait_ready": "the readiness answer of a program the demo started",
    "tools/demo_stack.py::first_page": "the demo's own Grafana / Prometheus on loopback",
    "tools/demo_stack.py::http_json": "the demo's own Prometheus / Alertmanager on loopback",
}
