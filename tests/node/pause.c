/*
 * The pod sandbox's "pause" process for the end-to-end node (tests/src/node.rs): it holds the pod's
 * namespaces open and does nothing else. As PID 1 of the pod it must reap the zombies of any
 * process re-parented to it and exit promptly on SIGTERM/SIGINT (the kubelet stops sandboxes with
 * SIGTERM). Built static (`gcc -static`), so the image needs no libc.
 */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) {
    (void)sig;
    _exit(0);
}

static void on_child(int sig) {
    (void)sig;
    /* Reap every exited child; WNOHANG so that a live child never blocks the handler. */
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction stop = {.sa_handler = on_stop};
    struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
    if (sigaction(SIGTERM, &stop, NULL) < 0 || sigaction(SIGINT, &stop, NULL) < 0 ||
        sigaction(SIGCHLD, &child, NULL) < 0) {
        return 1;
    }
    for (;;) {
        pause();
    }
}
