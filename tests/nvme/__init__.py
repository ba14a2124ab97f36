"""The nvme target: its passthrough commands, and the guest's NVMe device."""
