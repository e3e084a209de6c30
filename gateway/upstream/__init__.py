"""The backend behind the API: the cluster view, worker clients, the prefill → decode
handoff and the relay of tokens across attempts."""
