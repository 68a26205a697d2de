"""Kubelet gRPC APIs (device plugin v1beta1, PodResources v1): generated code, do not edit."""
