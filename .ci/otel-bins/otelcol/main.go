// Command otelcol-kvobs is a minimal OpenTelemetry Collector distribution for
// kvobs-otel's end-to-end tests. The component list lives in components.go;
// every collector module is pinned in go.mod at one release (see ../README.md).
package main

import (
	"os"

	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/confmap"
	"go.opentelemetry.io/collector/confmap/provider/envprovider"
	"go.opentelemetry.io/collector/confmap/provider/fileprovider"
	"go.opentelemetry.io/collector/confmap/provider/yamlprovider"
	"go.opentelemetry.io/collector/otelcol"
)

// version is overridden at link time by build.sh (-X main.version=...).
var version = "dev"

func main() {
	set := otelcol.CollectorSettings{
		BuildInfo: component.BuildInfo{
			Command:     "otelcol-kvobs",
			Description: "kvobs-otel test Collector distribution",
			Version:     version,
		},
		Factories: components,
		ConfigProviderSettings: otelcol.ConfigProviderSettings{
			ResolverSettings: confmap.ResolverSettings{
				ProviderFactories: []confmap.ProviderFactory{
					envprovider.NewFactory(),
					fileprovider.NewFactory(),
					yamlprovider.NewFactory(),
				},
			},
		},
	}
	// cobra already prints the error; only the exit code is left to set.
	if err := otelcol.NewCommand(set).Execute(); err != nil {
		os.Exit(1)
	}
}
