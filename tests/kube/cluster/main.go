// Command kube-plane is the test suite's Kubernetes control plane in one binary: kube-apiserver,
// kube-controller-manager, kube-scheduler and etcd, each the upstream command built from its Go
// module at the version go.mod pins. One binary links once instead of four times (the packages
// they share compile once either way), which is most of a cold build's saving.
//
// Usage: kube-plane COMPONENT [FLAGS...], COMPONENT one of apiserver, controller-manager,
// scheduler, etcd. tests/kube/build.py builds it; tests/kube/cluster.py starts it.
package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: kube-plane apiserver|controller-manager|scheduler|etcd [flags]")
		os.Exit(2)
	}
	component, rest := os.Args[1], os.Args[2:]
	var command *cobra.Command
	switch component {
	case "apiserver":
		command = apiserver.NewAPIServerCommand()
	case "controller-manager":
		command = controllermanager.NewControllerManagerCommand()
	case "scheduler":
		command = scheduler.NewSchedulerCommand()
	case "etcd":
		// etcdmain reads os.Args itself, program name first
		etcdmain.Main(append([]string{"etcd"}, rest...))
		return
	default:
		fmt.Fprintf(os.Stderr, "kube-plane: unknown component %q (apiserver, controller-manager, scheduler, etcd)\n", component)
		os.Exit(2)
	}
	// cobra reads os.Args[1:] unless told otherwise: hand it the component's own flags
	command.SetArgs(rest)
	os.Exit(cli.Run(command))
}
