"""The qcow2 engine and target, judged by QEMU's own tools."""
