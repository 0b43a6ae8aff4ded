"""Every metric the exporter publishes, in one table: names, types, label names and help.

The exporter builds its families from this table; the detection benchmark's simulator publishes the
same names and the tests hold both (and docs/contract.md) to it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Spec:
    kind: str  # "gauge" or "counter"
    help: str
    labels: tuple[str, ...] = ()


def _g(help_: str, *labels: str) -> Spec:
    return Spec("gauge", help_, labels)


def _c(help_: str, *labels: str) -> Spec:
    return Spec("counter", help_, labels)


LEGACY_NVLINK_ERROR_TYPES = ("crc_flit", "crc_data", "replay", "recovery")  # nvmlDeviceGetNvLinkErrorCounter
REMAP_AVAILABILITY = ("max", "high", "partial", "low", "none")
RECOVERY_ACTIONS = ("none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset",  # NVML 0..7
                    "recover_imex_domain", "bus_reset", "system_reboot")
KMSG_RESULTS = ("xid", "sxid", "aer", "fallen_off_bus", "ignored", "malformed", "not_kernel", "over_limit")
CLOCK_EVENT_REASONS = ("gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown", "sync_boost",
                       "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown",
                       "display_clock_setting")
# The exporter's collectors, as ``gpuhealth_collector_success{collector}`` names them.
COLLECTORS = ("fabric", "gpu", "host", "jobs", "nfs", "xid")
# InfiniBand port error counters (sysfs ``counters/``): ``error`` of gpuhealth_nic_port_errors_total.
NIC_PORT_ERRORS = ("symbol_error", "link_error_recovery", "port_rcv_errors",
                   "port_rcv_remote_physical_errors", "port_xmit_discards", "local_link_integrity_errors",
                   "excessive_buffer_overrun_errors", "port_rcv_constraint_errors")
# Error-like ``hw_counters/`` (mlx5), the ``counter`` label of gpuhealth_nic_port_hw_errors_total: transport
# retries, sequence errors and completions in error; the congestion and request counters are load, not health.
NIC_HW_ERRORS = ("duplicate_request", "implied_nak_seq_err", "local_ack_timeout_err", "out_of_buffer",
                 "out_of_sequence", "packet_seq_err", "req_cqe_error", "req_remote_access_errors",
                 "req_remote_invalid_request", "req_transport_retries_exceeded", "resp_cqe_error",
                 "resp_local_length_error", "resp_remote_access_errors", "rnr_nak_retry_err",
                 "rx_icrc_encapsulated")
NIC_AFFINITY_SCOPES = ("pcie_switch", "numa_node")
FABRIC_READ_ERRORS = ("missing", "permission", "malformed", "io")

SPECS: dict[str, Spec] = {
    # exporter and node level
    "gpuhealth_exporter_build_info": _g("Exporter version and NVML backend; always 1.", "version", "backend"),
    "gpuhealth_collector_success": _g("1 when the collector's last run succeeded.", "collector"),
    "gpuhealth_collector_duration_seconds": _g("Duration of the collector's last run.", "collector"),
    "gpuhealth_gpus_expected": _g("GPUs this node should have: from config, else NVIDIA GPUs on the PCI "
                                  "bus."),
    "gpuhealth_nvml_up": _g("1 while NVML is initialised and answers."),
    "gpuhealth_nvml_init_errors_total": _c("Failed NVML initialisations, by error.", "error"),
    "gpuhealth_nvml_stalled": _g("1 while every GPU missed its NVML deadline at once (a driver-wide stall)."),
    "gpuhealth_xid_nvml_registered": _g("1 while the GPU is registered for NVML XID events.", "gpu"),
    "gpuhealth_xid_nvml_wait_errors_total": _c("Errors from waiting on the NVML XID event set.", "error"),
    "gpuhealth_gpus_visible": _g("GPUs that NVML enumerates and that answer now."),
    "gpuhealth_sxid_events_total": _c("NVSwitch SXID events from the kernel log.",
                                      "device", "sxid", "severity"),
    "gpuhealth_pcie_aer_errors_total": _c("PCIe AER errors reported in the kernel log.",
                                          "pci_bus_id", "severity", "gpu"),
    "gpuhealth_kmsg_lines_total": _c("Kernel log lines read, by how they were classified.", "result"),
    # GPU level
    "gpuhealth_gpu_info": _g("GPU identity; always 1.", "gpu", "uuid", "pci_bus_id", "model", "serial",
                             "driver_version", "vbios_version"),
    "gpuhealth_gpu_up": _g("1 while the GPU answers NVML.", "gpu"),
    "gpuhealth_gpu_nvml_errors_total": _c("NVML errors: query sample marked the GPU down, others left a "
                                          "series out.", "gpu", "error", "query"),
    "gpuhealth_gpu_nvml_latency_seconds": _g("NVML time for one full sample of the GPU, max over the window.",
                                             "gpu"),
    "gpuhealth_gpu_temperature_celsius": _g("GPU core temperature.", "gpu"),
    "gpuhealth_gpu_temperature_max_celsius": _g("Maximum GPU temperature over the sampling window.", "gpu"),
    "gpuhealth_gpu_memory_temperature_celsius": _g("HBM temperature.", "gpu"),
    "gpuhealth_gpu_memory_temperature_threshold_celsius": _g("Maximum operating HBM temperature.", "gpu"),
    "gpuhealth_gpu_temperature_slowdown_threshold_celsius": _g("Temperature at which the GPU slows down.",
                                                               "gpu"),
    "gpuhealth_gpu_temperature_shutdown_threshold_celsius": _g("Temperature at which the GPU shuts down.",
                                                               "gpu"),
    "gpuhealth_gpu_temperature_slowdown_margin_celsius": _g(
        "Slowdown threshold minus the maximum temperature over the window.", "gpu"),
    "gpuhealth_gpu_power_watts": _g("Power draw.", "gpu"),
    "gpuhealth_gpu_power_limit_watts": _g("Enforced power limit.", "gpu"),
    "gpuhealth_gpu_sm_clock_hertz": _g("Current SM clock.", "gpu"),
    "gpuhealth_gpu_sm_clock_max_hertz": _g("Maximum SM clock.", "gpu"),
    "gpuhealth_gpu_memory_clock_hertz": _g("Current memory clock.", "gpu"),
    "gpuhealth_gpu_memory_clock_max_hertz": _g("Maximum memory clock.", "gpu"),
    "gpuhealth_gpu_clock_event_active": _g("1 while the clock event (throttle) reason is active.",
                                           "gpu", "reason"),
    "gpuhealth_gpu_clock_event_seconds_total": _c("Time spent with the clock event reason active.",
                                                  "gpu", "reason"),
    "gpuhealth_gpu_utilization_ratio": _g("Fraction of time a kernel was running.", "gpu"),
    "gpuhealth_gpu_memory_utilization_ratio": _g("Fraction of time device memory was read or written.",
                                                 "gpu"),
    "gpuhealth_gpu_memory_used_bytes": _g("Device memory in use.", "gpu"),
    "gpuhealth_gpu_memory_total_bytes": _g("Device memory installed.", "gpu"),
    "gpuhealth_gpu_ecc_errors_total": _c("ECC errors by type and NVML counter.", "gpu", "type", "counter"),
    "gpuhealth_gpu_ecc_location_errors_total": _c("ECC errors by type, NVML counter and location.",
                                                  "gpu", "type", "counter", "location"),
    "gpuhealth_gpu_ecc_enabled": _g("1 while ECC is enabled.", "gpu"),
    "gpuhealth_gpu_ecc_pending_enabled": _g("1 when ECC will be enabled after the next reset.", "gpu"),
    "gpuhealth_gpu_retired_pages": _g("Pages retired, by cause.", "gpu", "cause"),
    "gpuhealth_gpu_retired_pages_pending": _g("1 while a page retirement waits for a reset.", "gpu"),
    "gpuhealth_gpu_remapped_rows": _g("HBM rows remapped, by error type.", "gpu", "type"),
    "gpuhealth_gpu_remap_pending": _g("1 while a row remap waits for a reset.", "gpu"),
    "gpuhealth_gpu_remap_failure": _g("1 when a row remap failed.", "gpu"),
    "gpuhealth_gpu_row_remap_availability_banks": _g("Memory banks by spare remap rows left.",
                                                     "gpu", "availability"),
    "gpuhealth_gpu_pcie_replays_total": _c("PCIe replay events.", "gpu"),
    "gpuhealth_gpu_pcie_errors_total": _c("PCIe errors the GPU counted, by type.", "gpu", "type"),
    "gpuhealth_gpu_pcie_link_generation": _g("Current PCIe link generation.", "gpu"),
    "gpuhealth_gpu_pcie_link_generation_max": _g("Maximum PCIe link generation.", "gpu"),
    "gpuhealth_gpu_pcie_link_width_lanes": _g("Current PCIe link width.", "gpu"),
    "gpuhealth_gpu_pcie_link_width_max_lanes": _g("Maximum PCIe link width.", "gpu"),
    "gpuhealth_gpu_pcie_link_downgraded": _g("1 when PCIe generation or width is below its maximum.", "gpu"),
    "gpuhealth_gpu_nvlink_up": _g("1 while the NVLink is active.", "gpu", "link"),
    "gpuhealth_gpu_nvlink_errors_total": _c("NVLink errors by link and type.", "gpu", "link", "type"),
    "gpuhealth_gpu_nvlink_errors_all_links_total": _c(
        "NVLink errors summed over the GPU's links (CRC, replay, recovery; NVLink5 effective, receive).",
        "gpu"),
    "gpuhealth_gpu_nvlink_recoveries_total": _c("NVLink5 link recoveries by result.",
                                                "gpu", "link", "result"),
    "gpuhealth_gpu_nvlink_bit_error_rate": _g("NVLink5 bit error rate (symbol: raw, effective: after FEC).",
                                              "gpu", "link", "type"),
    "gpuhealth_gpu_nvlink_fec_history_total": _c("NVLink5 FEC codewords by corrected-symbol bin.",
                                                 "gpu", "link", "bin"),
    "gpuhealth_gpu_fabric_state": _g("1 for the GPU's NVLink fabric registration state.", "gpu", "state"),
    "gpuhealth_gpu_fabric_status_ok": _g("1 when the fabric registration succeeded.", "gpu"),
    "gpuhealth_gpu_fabric_bandwidth_degraded": _g("1 when the fabric reports degraded NVLink bandwidth.",
                                                  "gpu"),
    "gpuhealth_gpu_processes": _g("Compute processes running on the GPU.", "gpu"),
    "gpuhealth_gpu_job_info": _g("A Slurm job using the GPU; always 1.", "gpu", "job_id"),
    "gpuhealth_xid_events_total": _c("XID events from NVML and the kernel log, counted once.", "gpu", "xid"),
    "gpuhealth_gpu_fallen_off_bus_total": _c("Kernel log lines saying the GPU has fallen off the bus.",
                                             "gpu"),
    "gpuhealth_gpu_recovery_action": _g("1 for the recovery action the driver requests (NVML, else XID 154).",
                                        "gpu", "action"),
    # fabric: InfiniBand/RoCE ports, their netdevs, GPU-to-NIC placement, the NVSwitch fabric manager
    "gpuhealth_nic_port_info": _g("NIC port identity; always 1.", "device", "port", "link_layer", "netdev",
                                  "switch"),
    "gpuhealth_nic_port_up": _g("1 while the port is ACTIVE and its physical link is LinkUp.",
                                "device", "port"),
    "gpuhealth_nic_port_state": _g("InfiniBand PortState number (1 DOWN .. 4 ACTIVE).", "device", "port"),
    "gpuhealth_nic_port_physical_state": _g("InfiniBand PortPhysicalState number (5 LinkUp).",
                                            "device", "port"),
    "gpuhealth_nic_port_rate_bytes_per_second": _g("Port rate as the link trained.", "device", "port"),
    "gpuhealth_nic_port_expected_rate_bytes_per_second": _g("Port rate the configuration expects.",
                                                            "device", "port"),
    "gpuhealth_nic_port_link_downed_total": _c("Times link training failed and the port went down.",
                                               "device", "port"),
    "gpuhealth_nic_port_errors_total": _c("InfiniBand port error counters, by counter.", "device", "port",
                                          "error"),
    "gpuhealth_nic_port_hw_errors_total": _c("Error-like hardware counters of the port, by counter.",
                                             "device", "port", "counter"),
    "gpuhealth_netdev_carrier_changes_total": _c("Carrier changes of the RoCE network interface.", "netdev"),
    "gpuhealth_netdev_up": _g("1 while the RoCE network interface's operstate is up.", "netdev"),
    "gpuhealth_netdev_speed_bytes_per_second": _g("Link speed of the RoCE network interface.", "netdev"),
    "gpuhealth_nic_gpu_affinity_info": _g("A GPU near the NIC (same PCIe switch, else NUMA node); always 1.",
                                          "device", "gpu", "scope"),
    "gpuhealth_fabric_manager_up": _g("1 while the NVSwitch fabric manager is active."),
    "gpuhealth_fabric_read_errors_total": _c("Fabric sysfs reads that failed, the series left out, by error.",
                                             "device", "error"),
    # host
    "gpuhealth_host_cpu_seconds_total": _c("CPU time by mode, all CPUs together.", "mode"),
    "gpuhealth_host_memory_total_bytes": _g("Physical memory."),
    "gpuhealth_host_memory_available_bytes": _g("Memory available for new work without swapping."),
    "gpuhealth_host_load1": _g("One-minute load average."),
    "gpuhealth_host_interrupts_total": _c("Interrupts serviced."),
    "gpuhealth_host_context_switches_total": _c("Context switches."),
    "gpuhealth_host_procs_running": _g("Runnable processes."),
    "gpuhealth_host_page_outs_total": _c("Pages paged out (pgpgout)."),
    "gpuhealth_host_swap_outs_total": _c("Pages swapped out (pswpout)."),
    "gpuhealth_host_disk_read_bytes_total": _c("Bytes read from the disk.", "device"),
    "gpuhealth_host_disk_written_bytes_total": _c("Bytes written to the disk.", "device"),
    "gpuhealth_host_network_receive_bytes_total": _c("Bytes received on the interface.", "device"),
    "gpuhealth_host_network_transmit_bytes_total": _c("Bytes sent on the interface.", "device"),
    # NFS client
    "gpuhealth_nfs_rpc_operations_total": _c("NFS RPC operations completed.", "mount", "op"),
    "gpuhealth_nfs_rpc_transmissions_total": _c("NFS RPC transmissions, retransmissions included.",
                                                "mount", "op"),
    "gpuhealth_nfs_rpc_queue_seconds_total": _c("Time NFS RPCs waited in the client queue.", "mount", "op"),
    "gpuhealth_nfs_rpc_rtt_seconds_total": _c("NFS RPC round-trip time.", "mount", "op"),
    "gpuhealth_nfs_rpc_execute_seconds_total": _c("NFS RPC total execution time.", "mount", "op"),
    "gpuhealth_nfs_transport_sends_total": _c("RPC requests sent on the mount's transport.", "mount"),
    "gpuhealth_nfs_transport_backlog_queue_total": _c("Cumulative RPC backlog queue length at each send.",
                                                      "mount"),
}
